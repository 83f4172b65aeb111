"""One process of the weights-I/O run (tests/test_weights_io.py): load a gs:// checkpoint (a
counting object-store stand-in, `counting_fs.LocalStore`) onto a mesh whose process-spanning axis
(fsdp) shards every large leaf, measuring bytes read at the storage layer and peak RSS growth
(/proc/self/status after /proc/self/clear_refs); then fingerprint the parameters and publish them
to gs:// (bytes written counted the same way). Writes <out>/result_<nproc>_<pid>.json.

Usage: GAGAR_TEST_STORE_ROOT=DIR python weights_io_worker.py CKPT OUT NPROC PID PORT
"""
import json
import os
import sys
import types

import jax


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main(ckpt: str, out: str, nproc: int, pid: int, port: int) -> None:
    if nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                                   process_id=pid)
    import counting_fs
    import numpy as np
    from flax import nnx
    counting_fs.register(counting_fs.LocalStore)
    counts = counting_fs.COUNTS

    from gagar_jax import sharding
    from gagar_jax.hf import api as hf
    from gagar_jax.run import metrics, publish

    fast = dict(expert_backend="dense", attention="plain")
    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=2, expert=-1, tensor=1))
    with open("/proc/self/clear_refs", "w") as f:   # peak RSS := current RSS
        f.write("5")
    rss0, read0 = _status_kb("VmRSS"), counts["read"]
    model, _ = hf.from_pretrained(ckpt, mesh=mesh, **fast)
    jax.block_until_ready(nnx.state(model))
    hwm = _status_kb("VmHWM")
    res = {"read": counts["read"] - read0, "rss_growth": (hwm - rss0) * 1024}
    res["sha256"], res["l2"] = metrics.params_fingerprint(nnx.state(model))
    if nproc > 1:
        pub = publish.Publisher("gs://bkt/work", dtype="float32")
        written0 = counts["write"]
        res["published"] = pub.publish(model, 7)
        pub.close()
        res["written"] = counts["write"] - written0
        res["publisher_bytes"] = pub.last_bytes
    else:   # the reference logits of the loaded model
        tokens = np.arange(16, dtype=np.int32).reshape(2, 8) * 37 % model.cfg.vocab_size
        logits = nnx.jit(lambda m, t: m(t)[0])(model, jax.numpy.asarray(tokens))
        np.save(os.path.join(out, "logits.npy"), np.asarray(logits))
        np.save(os.path.join(out, "tokens.npy"), tokens)
    with open(os.path.join(out, f"result_{nproc}_{pid}.json"), "w") as f:
        json.dump(res, f)
    if nproc > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
