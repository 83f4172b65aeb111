"""Weights I/O at pod scale: byte-range reads (local and object store), block-FP8 boxes, the
streaming sharded load against an independent reader, per-unit reshard, object-store publishing,
and ONE 2-process x 4-device run on a ~120 MB checkpoint (bytes read and written per process,
peak RSS, fingerprints equal to one process, transformers logit parity of the published model)."""
import json
import os
import subprocess
import sys
import threading
import types

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file
from support import counting_fs
from support.close import assert_rel_close
from support.trainer_runs import REPO, env, free_port
from support.xla_flags import FAST_COMPILE

from gagar_jax import sharding
from gagar_jax.hf import api as hf
from gagar_jax.hf import load as hf_load
from gagar_jax.hf import save as hf_save
from gagar_jax.hf import units as param_units
from gagar_jax.hf.safetensors import Checkpoint, dequantize_block_fp8, write_safetensors
from gagar_jax.model.transformer import Transformer
from gagar_jax.run import publish

FAST = dict(expert_backend="dense", attention="plain")


def _qwen(**kw) -> dict:
    base = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=64,
                hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                decoder_sparse_step=1, rope_theta=1000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False, hidden_act="silu")
    base.update(kw)
    return base


def _save_random(hf_cfg: dict, path, seed: int = 0) -> None:
    """A random checkpoint written with NumPy (no JAX init): names and shapes from the family."""
    cfg = hf.config_from_hf(hf_cfg, **FAST)
    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    leaves = {
        sharding.leaf_path(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, t in hf_save.plan_save(leaves, cfg, 1, "float32").tensors.items():
        w = rng.standard_normal(t.shape, dtype=np.float32)
        tensors[name] = (
            1.0 + 0.1 * w if "norm" in name else w * np.float32(0.6 / np.sqrt(t.shape[-1]))
        )
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf.config_to_hf(cfg, "float32"), f)


@pytest.fixture(scope="module")
def memory_store():
    counting_fs.register(counting_fs.MemoryStore)
    yield counting_fs.COUNTS


# -- byte-range reads ---------------------------------------------------------------------------

@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data(),
       st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int16]))
def test_read_box_reads_exactly_the_box(tmp_path_factory, memory_store, shape, data, dtype):
    rng = np.random.default_rng(len(shape))
    arr = (rng.standard_normal(shape) * 100).astype(dtype)
    d = tmp_path_factory.mktemp("box")
    box = [tuple(sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2))))
           for n in shape]
    want = arr[tuple(slice(a, b) for a, b in box)]
    for where in (d, "gs://t/hyp"):   # memory-mapped local file; ranged reads on a store
        write_safetensors(f"{where}/model.safetensors", {"pad": np.zeros(3, np.float32), "t": arr})
        ckpt = Checkpoint(where)
        ckpt.entry("t")
        before = memory_store["read"]
        np.testing.assert_array_equal(ckpt.read_box("t", box), want)
        if where != d:
            assert memory_store["read"] - before == want.nbytes


def test_object_store_read_counts_only_the_box(memory_store, tmp_path):
    arr = np.arange(40 * 24, dtype=np.float32).reshape(40, 24)
    write_safetensors("gs://t/box/model.safetensors", {"w": arr})
    ckpt = Checkpoint("gs://t/box")
    ckpt.entry("w")                   # the header, read once
    before = memory_store["read"]
    got = ckpt.read_box("w", [(3, 9), (4, 10)])   # 6 rows x 6 columns
    assert memory_store["read"] - before == 6 * 6 * 4
    np.testing.assert_array_equal(got, arr[3:9, 4:10])


def test_fp8_box_dequantizes_only_its_blocks(tmp_path):
    rng = np.random.default_rng(0)
    q8 = (rng.standard_normal((300, 260)) * 50).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.1, 2.0, size=(3, 3)).astype(np.float32)
    write_safetensors(tmp_path / "model.safetensors", {"w": q8, "w_scale_inv": scale})
    full = dequantize_block_fp8(q8, scale)
    src = hf_load.Source(tmp_path, (128, 128))
    assert src.names == {"w"}
    for box in ([(0, 300), (0, 260)], [(127, 129), (250, 260)], [(130, 300), (5, 140)]):
        np.testing.assert_array_equal(
            src.read("w", box), full[box[0][0] : box[0][1], box[1][0] : box[1][1]]
        )


def test_views_match_numpy_transforms(tmp_path):
    """Our box of a stored tensor, per transform, equals the whole transform sliced by NumPy."""
    rng = np.random.default_rng(1)
    H, Dh, D, E, F = 4, 3, 5, 2, 6
    t = {"qo": rng.standard_normal((H * Dh, D)).astype(np.float32),   # heads_out
         "oi": rng.standard_normal((D, H * Dh)).astype(np.float32),   # heads_in
         "gu": rng.standard_normal((E, 2 * F, D)).astype(np.float32)}  # fused gate_up
    write_safetensors(tmp_path / "model.safetensors", t)
    src = hf_load.Source(tmp_path, None)
    cases = [("qo", "heads_out", t["qo"].T.reshape(D, H, Dh)),
             ("oi", "heads_in", t["oi"].T.reshape(H, Dh, D)),
             ("gu", "fused_gate", t["gu"][:, :F].transpose(0, 2, 1)),
             ("gu", "fused_up", t["gu"][:, F:].transpose(0, 2, 1))]
    for name, transform, want in cases:
        view = hf_load.view_of(transform, src.shape(name), want.shape)
        shape = want.shape
        for box in ([(0, n) for n in shape], [(1, min(3, n)) for n in shape],
                    [(0, 1), (shape[1] // 2, shape[1]), (max(shape[2] - 2, 0), shape[2])]):
            got = src.read_view(name, view, box)
            np.testing.assert_array_equal(got, want[tuple(slice(a, b) for a, b in box)])
        with pytest.raises(ValueError, match="does not fit"):
            src.read_view(name, view, [(0, n + 1) for n in shape])


# -- streaming load and canonical units ---------------------------------------------------------

@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    _save_random(_qwen(), d)
    return d


def test_streaming_load_on_a_mesh_equals_an_independent_reader(small_ckpt, devices, memory_store):
    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=2, expert=2, tensor=2))
    model, _ = hf.from_pretrained(str(small_ckpt), mesh=mesh, **FAST)
    raw = load_file(str(small_ckpt / "model.safetensors"))   # the safetensors package's reader
    wq = model.moe_layers.attn.wq[...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, ("fsdp", "expert"), "tensor", None)
    np.testing.assert_array_equal(
        np.asarray(wq[1]), raw["model.layers.2.self_attn.q_proj.weight"].T.reshape(32, 4, 8)
    )
    np.testing.assert_array_equal(np.asarray(model.moe_layers.attn.wo[0]),
                                  raw["model.layers.1.self_attn.o_proj.weight"].T.reshape(4, 8, 32))
    np.testing.assert_array_equal(np.asarray(model.moe_layers.mlp.expert_down[1, 3]),
                                  raw["model.layers.2.mlp.experts.3.down_proj.weight"].T)
    np.testing.assert_array_equal(
        np.asarray(model.embedding[...]), raw["model.embed_tokens.weight"]
    )
    # The same bytes from an object store, reading no more than the checkpoint holds.
    files = ("config.json", "model.safetensors")
    for name in files:
        with open(small_ckpt / name, "rb") as f, \
                counting_fs.MemoryStore().open(f"gs://t/small/{name}", "wb") as g:
            g.write(f.read())
    before = memory_store["read"]
    remote, _ = hf.from_pretrained("gs://t/small", mesh=mesh, **FAST)
    assert memory_store["read"] - before <= os.path.getsize(small_ckpt / "model.safetensors") + 4096
    for a, b in zip(
        jax.tree.leaves(nnx.state(remote)), jax.tree.leaves(nnx.state(model)), strict=False
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_units_reshard_to_their_owner(devices):
    x = np.arange(2 * 4 * 6 * 8, dtype=np.float32).reshape(2, 4, 6, 8)   # [L, E, D, F]
    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=2, expert=2, tensor=2))
    xs = jax.device_put(x, sharding.named_sharding(mesh, ("layers", "expert", "expert_embed",
                                                           "mlp")))
    lu = param_units.plan({"moe_layers/mlp/expert_gate": xs}, 1, lambda n, v: "bfloat16")[
        "moe_layers/mlp/expert_gate"]
    assert (lu.lead, lu.units, lu.unit_shape) == (2, 8, (6, 8))
    units = param_units.host_units(param_units.to_owners(xs, lu, param_units.process_mesh()), lu)
    assert sorted(units) == list(range(8))
    for u, w in units.items():
        np.testing.assert_array_equal(w, x.reshape(8, 6, 8)[u].astype(ml_dtypes.bfloat16))
    # Two processes' plan: every unit has exactly one owner, bytes balanced within one unit.
    two = param_units.plan(
        {
            "a/embedding": jax.ShapeDtypeStruct((64, 32), np.float32),
            "moe_layers/mlp/expert_gate": jax.ShapeDtypeStruct((3, 4, 32, 16), np.float32),
            "moe_layers/attn/wq": jax.ShapeDtypeStruct((3, 32, 4, 8), np.float32),
        },
        2,
        lambda n, v: "float32",
    )
    load = np.zeros(2)
    for lu in two.values():
        for u in range(lu.units):
            load[lu.owner(u)] += lu.unit_bytes
    assert abs(load[0] - load[1]) <= max(lu.unit_bytes for lu in two.values())


def test_publish_to_an_object_store_without_rename_or_append(small_ckpt, memory_store, devices):
    model, _ = hf.from_pretrained(str(small_ckpt), **FAST)
    seen = []
    pub = publish.Publisher("gs://t/work", dtype="float32", keep=1,
                            publish_fn=lambda step, share, d: seen.append((step, sorted(share))))
    for step in (1, 2):
        pub.publish(model, step)
    pub.close()
    assert publish.read_latest("gs://t/work") == {"step": 2, "policy_version": 2,
                                                  "path": "gs://t/work/published/step_00000002"}
    assert publish.published_steps("gs://t/work") == [2]     # keep=1 pruned step 1
    assert [s for s, _ in seen] == [1, 2] and "model.embed_tokens.weight" in seen[0][1]
    again, _ = hf.from_pretrained("gs://t/work/published/step_00000002", **FAST)
    for a, b in zip(
        jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model)), strict=False
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_next_publish_waits_for_the_write_in_flight(small_ckpt, tmp_path, devices):
    model, _ = hf.from_pretrained(str(small_ckpt), **FAST)
    gate, calls = threading.Event(), []

    def slow(step, share, directory):
        calls.append(step)
        assert gate.wait(60)
        if step == 3:
            raise OSError("sync failed")

    pub = publish.Publisher(tmp_path, dtype="float32", publish_fn=slow)
    pub.publish(model, 1)            # returns with the write still running
    assert publish.read_latest(tmp_path) is None
    second = threading.Thread(target=pub.publish, args=(model, 2))
    second.start()
    second.join(0.5)
    assert second.is_alive() and calls == [1]   # step 2 waits for step 1's write
    gate.set()
    second.join(60)
    pub.wait()
    assert publish.read_latest(tmp_path)["step"] == 2 and calls == [1, 2]
    pub.publish(model, 3)
    with pytest.raises(RuntimeError, match="sync failed"):
        pub.close()  # a failed background write surfaces here
    assert publish.read_latest(tmp_path)["step"] == 2 and publish.published_steps(tmp_path) == [
        1,
        2,
    ]


# -- the 2-process run --------------------------------------------------------------------------

BIG = _qwen(vocab_size=4096, hidden_size=256, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, moe_intermediate_size=512, num_experts=16,
            intermediate_size=512, mlp_only_layers=[0])


def test_two_processes_load_and_publish_their_shares(tmp_path):
    store = tmp_path / "store"
    ckpt = store / "bkt" / "ckpt"
    ckpt.mkdir(parents=True)
    _save_random(BIG, ckpt, seed=3)
    ckpt_bytes = os.path.getsize(ckpt / "model.safetensors")
    assert 100e6 <= ckpt_bytes <= 200e6, ckpt_bytes
    worker = os.path.join(REPO, "tests", "support", "weights_io_worker.py")
    port = free_port()
    runs = [(1, 0, 8), (2, 0, 4), (2, 1, 4)]   # (processes, process id, devices per process)
    procs = []
    for nproc, pid, ndev in runs:
        e = env(ndev, FAST_COMPILE)     # -O0: each program is compiled for one call here
        e.update(GAGAR_TEST_STORE_ROOT=str(store),
                 PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    worker,
                    "gs://bkt/ckpt",
                    str(tmp_path),
                    str(nproc),
                    str(pid),
                    str(port),
                ],
                cwd=REPO,
                env=e,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    one, *two = [json.loads((tmp_path / f"result_{n}_{i}.json").read_text()) for n, i, _ in runs]
    print(json.dumps({"checkpoint_bytes": ckpt_bytes, "one": one, "two": two}))
    assert one["read"] >= ckpt_bytes       # the counter sees every byte a lone process needs
    for r in two:
        # Bytes read at the storage layer, and peak RSS growth against one process loading alone.
        assert 0.3 * ckpt_bytes <= r["read"] <= 0.6 * ckpt_bytes, (r["read"], ckpt_bytes)
        assert r["rss_growth"] <= 0.75 * one["rss_growth"], (r["rss_growth"], one["rss_growth"])
        # Fingerprints per canonical unit: identical on 1 and 2 processes.
        assert (r["sha256"], r["l2"]) == (one["sha256"], one["l2"])
    published = store / "bkt" / "work" / "published" / "step_00000007"
    pointer = json.loads((store / "bkt" / "work" / "published" / "latest").read_text())
    assert pointer == {"step": 7, "policy_version": 7, "path": "gs://bkt/work/published/step_00000007"}
    total = sum(
        os.path.getsize(published / f) for f in os.listdir(published) if f.endswith(".safetensors")
    )
    for r in two:
        assert 0.3 * total <= r["written"] <= 0.7 * total, (r["written"], total)
    assert sum(r["publisher_bytes"] for r in two) == total
    # Published float32 tensors are the loaded ones, bit for bit, and transformers agrees.
    index = json.loads((published / "model.safetensors.index.json").read_text())["weight_map"]
    want = load_file(str(ckpt / "model.safetensors"))
    assert set(index) == set(want)
    for fname in sorted(set(index.values())):
        for name, w in load_file(str(published / fname)).items():
            np.testing.assert_array_equal(w, want[name])
    import torch
    from transformers import Qwen3MoeForCausalLM
    theirs = Qwen3MoeForCausalLM.from_pretrained(str(published)).eval()
    with torch.no_grad():
        logits = theirs(torch.tensor(np.load(tmp_path / "tokens.npy"))).logits.float().numpy()
    assert_rel_close(np.load(tmp_path / "logits.npy"), logits)
