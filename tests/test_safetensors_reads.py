"""Local safetensors reads: a truncated file is an error naming the file, the tensor and the byte
range (local and object store, and through `hf.from_pretrained`, the `init_from` path); a
box of a local file reads (almost) only its own pages from storage, measured with a cold page
cache through /proc/self/io (where the file system counts: tmpfs and overlay do not)."""
import json
import mmap
import os

import jax
import numpy as np
import pytest
from flax import nnx
from support.objectstore import use_memory_bucket

from gagar_jax import sharding
from gagar_jax.hf import api as hf
from gagar_jax.hf import safetensors as st
from gagar_jax.hf import save as hf_save
from gagar_jax.hf.safetensors import Checkpoint, write_safetensors
from gagar_jax.model.transformer import Transformer

TINY_QWEN = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=16,
                 hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, moe_intermediate_size=16, num_experts=2,
                 num_experts_per_tok=1, norm_topk_prob=True, mlp_only_layers=[0],
                 decoder_sparse_step=1, rope_theta=1000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, hidden_act="silu")


def _two_tensors(path):
    a = np.arange(16 * 64, dtype=np.float32).reshape(16, 64)
    b = np.ones((8, 8), np.float32)
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "model.safetensors"), {"a": a, "b": b})
    return os.path.join(path, "model.safetensors")


def _range(fname, name):
    header, start = st.read_header(fname)
    lo, hi = header[name]["data_offsets"]
    return start + lo, start + hi


def test_truncated_file_names_the_file_the_tensor_and_the_byte_range(tmp_path, monkeypatch):
    f = _two_tensors(tmp_path / "ck")
    lo, hi = _range(f, "a")
    os.truncate(f, lo + 100)   # "a" (written first) is cut inside its data
    ck = Checkpoint(tmp_path / "ck")
    want = (f"{f} is truncated: tensor a needs bytes [{lo}, {hi}) of the file, which has "
            f"{lo + 100} bytes")
    for box in (None, [(8, 16), (0, 64)]):
        with pytest.raises(ValueError) as e:
            ck.read_box("a", box)
        assert str(e.value) == want
    os.truncate(f, 5)          # not even the header length
    with pytest.raises(ValueError, match=r"model.safetensors: not a safetensors file: 5 bytes"):
        Checkpoint(tmp_path / "ck")

    fs = use_memory_bucket(monkeypatch)   # object store: ranged reads find the end early
    full = _two_tensors(tmp_path / "ck2")
    blob = open(full, "rb").read()
    with fs.open("gs://bkt/ck/model.safetensors", "wb") as g:
        g.write(blob[:lo + 100])
    with pytest.raises(ValueError) as e:
        Checkpoint("gs://bkt/ck").read_box("a", [(8, 16), (0, 64)])
    assert str(e.value) == (f"gs://bkt/ck/model.safetensors is truncated: tensor a needs bytes "
                            f"[{lo}, {hi}) of the file, which has {lo + 100} bytes")
    with fs.open("gs://bkt/ck/model.safetensors", "wb") as g:
        g.write(blob[:20])
    with pytest.raises(ValueError, match=r"truncated safetensors header: needs bytes \[8, "):
        Checkpoint("gs://bkt/ck")


def test_init_from_a_truncated_checkpoint_names_the_file_and_tensor(tmp_path):
    cfg = hf.config_from_hf(TINY_QWEN, expert_backend="dense", attention="plain")
    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    leaves = {sharding.leaf_path(kp): x
              for kp, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    tensors = {n: np.full(t.shape, 0.01, np.float32)
               for n, t in hf_save.plan_save(leaves, cfg, 1, "float32").tensors.items()}
    d = tmp_path / "ck"
    d.mkdir()
    f = str(d / "model.safetensors")
    write_safetensors(f, tensors)
    (d / "config.json").write_text(json.dumps(hf.config_to_hf(cfg, "float32")))
    size = os.path.getsize(f)
    os.truncate(f, size - 100)
    with pytest.raises(ValueError, match=rf"^{f} is truncated: tensor \S+ needs bytes \[\d+, "
                                         rf"\d+\) of the file, which has {size - 100} bytes$"):
        hf.from_pretrained(str(d), expert_backend="dense", attention="plain")


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _record_madvise(monkeypatch) -> list:
    """The reader's madvise calls on its real mappings, as (option, *args), in call order."""
    calls = []

    class Recording(mmap.mmap):
        def madvise(self, option, *a):
            calls.append((option, *a))
            return super().madvise(option, *a)
    shim = type("mmap_module", (), {k: getattr(mmap, k) for k in dir(mmap) if k.isupper()})
    shim.mmap = Recording
    monkeypatch.setattr(st, "mmap", shim)
    return calls


def test_local_box_reads_advise_random_access(tmp_path, monkeypatch):
    calls = _record_madvise(monkeypatch)
    x = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)   # 4 KiB rows
    write_safetensors(tmp_path / "model.safetensors", {"x": x})
    ck = Checkpoint(tmp_path)
    _, start = st.read_header(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(ck.read_box("x", [(3, 40), (0, 1024)]), x[3:40])
    assert calls[0] == (mmap.MADV_RANDOM,)
    # Then exactly the pages of rows 3..39, in pieces of at most WILLNEED_CHUNK.
    lo, hi = start + 3 * 4096, start + 40 * 4096
    lo, hi = lo // mmap.PAGESIZE * mmap.PAGESIZE, -(-hi // mmap.PAGESIZE) * mmap.PAGESIZE
    pieces = [c[1:] for c in calls[1:]]
    assert all(c[0] == mmap.MADV_WILLNEED for c in calls[1:])
    assert pieces[0][0] == lo and sum(n for _, n in pieces) == hi - lo
    assert all(n <= st.WILLNEED_CHUNK for _, n in pieces)
    calls.clear()
    np.testing.assert_array_equal(ck.read_box("x", [(0, 64), (5, 9)]), x[:, 5:9])
    assert calls[0] == (mmap.MADV_RANDOM,) and len(calls) > 1


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux /proc/self/io only")
def test_a_box_of_a_local_file_reads_only_its_pages_with_a_cold_cache(tmp_path, monkeypatch):
    # 4 blocks of 4 MiB; the box takes the first half of each: read-ahead (read_ahead_kb, often
    # 8 MiB) would bring in the other halves too.
    x = np.random.default_rng(0).integers(0, 255, (4, 2, 1 << 21), dtype=np.uint8)
    f = str(tmp_path / "model.safetensors")
    write_safetensors(f, {"x": x})
    size = os.path.getsize(f)
    ck = Checkpoint(tmp_path)
    _evict(f)
    before = _read_bytes()
    with open(f, "rb") as g:   # the control: a full read counts about the file's size
        while g.read(1 << 20):
            pass
    counts = _read_bytes() - before >= 0.9 * size   # not on tmpfs or overlay, for example
    calls = _record_madvise(monkeypatch)
    _evict(f)
    before = _read_bytes()
    got = ck.read_box("x", [(0, 4), (0, 1), (0, 1 << 21)])
    read = _read_bytes() - before
    np.testing.assert_array_equal(got, x[:, :1])
    # What the reader asks the kernel for: random access, then the box's half of the pages
    # (4 runs, each rounded out to whole pages).
    assert calls[0] == (mmap.MADV_RANDOM,)
    assert sum(c[2] for c in calls[1:]) <= x.nbytes / 2 + 4 * 2 * mmap.PAGESIZE
    if counts:   # and, where the file system counts reads, what the kernel then read
        assert read <= x.nbytes / 2 + 64 * 1024, (read, x.nbytes)
