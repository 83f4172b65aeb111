"""Manual vLLM check, step 2 (the vLLM venv, no JAX): vLLM against the learner, and reload.

    PYTHONPATH=. /path/.venv-vllm/bin/python scripts/vllm/check_engine.py WORKDIR

WORKDIR is one of `publish_tiny.py`'s (published/step_00000001, step_00000002, latest -> 2).
Runs two engines, each in its own process: a fresh load of step 2, and a load of step 1 that then
reloads `latest` (step 2) through GagarWorkerExtension. Prints, per engine, greedy-token agreement
and max |dlogprob| against the learner's ref.json, and whether reload == fresh bit for bit.
Not part of the test suite (vLLM is not installed in the learner's venv).
"""
import json
import os
import subprocess
import sys

EXT = "gagar_jax.rollout.vllm_extension.GagarWorkerExtension"


def run(mode, workdir, out):
    from vllm import LLM, SamplingParams

    from gagar_jax.rollout.vllm_extension import reload_latest
    pub = os.path.join(workdir, "published")
    start = os.path.join(pub, "step_00000002" if mode == "fresh" else "step_00000001")
    ref = json.load(open(os.path.join(pub, "step_00000002", "ref.json")))
    llm = LLM(model=start, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
              max_model_len=64, seed=0, worker_extension_cls=EXT)
    sp = SamplingParams(temperature=0.0, max_tokens=len(ref["greedy"]), logprobs=1,
                        prompt_logprobs=1, detokenize=False, ignore_eos=True)
    prompt = {"prompt_token_ids": ref["prompt"]}
    res = {}
    if mode == "reload":
        llm.generate([prompt], sp, use_tqdm=False)  # fills the prefix cache with step-1 KV
        res["reload"] = reload_latest(llm, workdir)
    res["routed_layers"] = llm.collective_rpc("gagar_capture_routes", args=(True,))[0]
    o = llm.generate([prompt], sp, use_tqdm=False)[0]
    toks = list(o.outputs[0].token_ids)
    res["greedy"] = toks
    res["gen_logprobs"] = [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(toks)]
    res["prompt_logprobs"] = [o.prompt_logprobs[i][ref["prompt"][i]].logprob
                              for i in range(1, len(ref["prompt"]))]
    res["routes"] = llm.collective_rpc("gagar_pop_routes")[0]
    json.dump(res, open(out, "w"))


def main(workdir):
    ref = json.load(open(os.path.join(workdir, "published", "step_00000002", "ref.json")))
    got = {}
    for mode in ("fresh", "reload"):
        out = os.path.join(workdir, f"vllm_{mode}.json")
        subprocess.run([sys.executable, __file__, mode, workdir, out], check=True)
        got[mode] = json.load(open(out))
    for mode, r in got.items():
        agree = sum(a == b for a, b in zip(r["greedy"], ref["greedy"], strict=True))
        n = min(agree + 1, len(ref["greedy"]))  # logprobs compared up to the first disagreement
        dgen = max(abs(a - b) for a, b in zip(r["gen_logprobs"][:n], ref["gen_logprobs"][:n],
                                              strict=True))
        dprompt = max(abs(a - b) for a, b in zip(r["prompt_logprobs"], ref["prompt_logprobs"],
                                                 strict=True))
        print(f"RESULT {workdir} {mode}: tokens agree {agree}/{len(ref['greedy'])}, "
              f"max|dlogprob| generated {dgen:.2e} prompt {dprompt:.2e}; "
              f"routed layers hooked {r['routed_layers']}, route calls {len(r['routes'])}")
    f, r = got["fresh"], got["reload"]
    same = all(f[k] == r[k] for k in ("greedy", "gen_logprobs", "prompt_logprobs", "routes"))
    print(f"RESULT {workdir} reload == fresh bit for bit: {same}; reload info "
          f"{ {k: v for k, v in r['reload'].items() if k != 'path'} }")


if __name__ == "__main__":
    if sys.argv[1] in ("fresh", "reload"):
        run(*sys.argv[1:4])
    else:
        main(sys.argv[1])
