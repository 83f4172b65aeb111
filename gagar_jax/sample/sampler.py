"""The paged sampler: live sequences in pages, continuous batching over a fixed set of decode slots.

    sampler = Sampler(model, SamplerConfig(slots=8, max_len=4096))
    [[a, b]] = sampler.generate([Work(prompt, [params_a, params_b])])    # 2 samples, one prefix
    [[c]] = sampler.generate([Work(tool_output, [params_c], sequence=a.sequence)])  # next turn
    sampler.cancel([a.sequence, b.sequence, c.sequence])

`generate` takes works (a prompt with one `SampleParams` per sample, or tokens appended to a live
sequence) and queues one job per sample. Between decode calls (`programs.decode`, up to
`decode_steps` steps of every slot) free slots admit queued jobs: a new prompt is prefilled once
(all but its last token, in chunks of at most `max_chunk`) and forked into its N samples, which
share its whole pages (`pages.Pages.fork`); a continuation prefills only what the sequence does
not hold yet (its last generated token and the appended ones); finished samples leave their slot
and stay live (their pages kept) until cancelled. Each decode step feeds a slot's last token, so
the first token of a sample is drawn from its own key like every later one.

New weights (`set_params`: a hand-over, or a version loaded by the engine) leave live sequences
live; their cached keys and values were computed with the old weights, so each re-prefills its
whole sequence on its next turn (its shared pages swapped for private ones first).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gagar_jax.kernels.attention import registry as attention_registry
from gagar_jax.sample import cache as cache_lib
from gagar_jax.sample import forward, programs
from gagar_jax.sample.forward import Chunk, Kernels
from gagar_jax.sample.pages import Pages, Sequence
from gagar_jax.sample.work import SampleParams, SamplerConfig, Turn, Work


@dataclasses.dataclass
class _Job:
    work: int
    sample: int
    params: SampleParams
    prefix: dict           # shared by a prompt's samples: {"tokens", "seqs"}
    seq: Sequence | None = None
    out: Turn | None = None


def _bucket(n: int, cap: int) -> int:
    """A chunk length: the next power of two from 16, at most `cap` rounded up to one."""
    return min(max(16, 1 << (n - 1).bit_length()), max(16, 1 << (cap - 1).bit_length()))


class Sampler:
    """Generation on the learner's model (see the module docstring).

    Args:
      model: a `Transformer` (its parameters are read, not copied).
      cfg: `SamplerConfig`.
      mesh: the sampler's mesh (None: one device): steps run under it, the cache replicated on it.
    """

    def __init__(self, model: Any, cfg: SamplerConfig, mesh: jax.sharding.Mesh | None = None):
        self.cfg, self.mesh = cfg, mesh
        self.graphdef, self.state = nnx.split(model)
        mc = self.model_cfg = model.cfg
        rp = cache_lib.ring_pages(mc, cfg.page)
        per_seq = -(-cfg.max_len // cfg.page)
        full = not mc.layer_types or "full" in mc.layer_types
        n_pages = (cfg.num_pages or 4 * cfg.slots * per_seq) if full else 0
        self.spec = cache_lib.CacheSpec(page=cfg.page, max_len=cfg.max_len, num_pages=n_pages,
                                        num_ring_pages=rp * (n_pages // per_seq or 4 * cfg.slots),
                                        ring_pages=rp, dtype=cfg.cache_dtype or mc.compute_dtype)
        self.pages = Pages(cfg.page, self.spec.num_pages, rp, self.spec.num_ring_pages)
        # The cache is committed where the parameters are (KV heads over `tensor` on a mesh),
        # and every step gives it back so: one program per bucket, never a second for a cache
        # the compiler chose to move.
        device = jax.tree.leaves(self.state)[0].devices().pop() if mesh is None else None
        self.cache_sharding = cache_lib.cache_shardings(mc, self.spec, mesh, device)
        self.cache = cache_lib.init_cache(mc, self.spec, self.cache_sharding)
        self.sliding = cache_lib.sliding_kinds(mc)
        same = mc.head_dim == mc.value_head_dim
        pick = lambda decode, window, sinks: attention_registry.resolve_paged(
            cfg.paged_attention, mesh, decode=decode, window=window, sinks=sinks, same_dims=same,
            head_dim=mc.head_dim)
        sw, sinks = mc.sliding_window if mc.has_sliding else 0, mc.attention_sinks
        self.kernels = {"prefill": Kernels(pick(False, 0, False), pick(False, sw, sinks)),
                        "decode": Kernels(pick(True, 0, False), pick(True, sw, sinks))}
        self.layers = forward.unstack(model) if cfg.layer_copies else None
        self.seqs: dict = {}
        self._ids = itertools.count()
        # what the scheduler did (tests and benchmarks read it): decode calls, prefill chunks,
        # forked samples, sequences admitted while other slots were decoding, finished ones
        self.stats = dict.fromkeys(("decode_calls", "prefill_chunks", "forks", "joined_running",
                                    "finished"), 0)

    # -------------------------------------------------------------- weights
    def set_params(self, state: nnx.State) -> None:
        """Serves `state` (same tree as the model's, any sharding) from the next step on; live
        sequences re-prefill on their next turn (their cache holds the old weights' keys)."""
        self.state = state
        if self.cfg.layer_copies:
            self.layers = forward.unstack(nnx.merge(self.graphdef, state))
        for seq in self.seqs.values():
            seq.fed = 0

    def release_params(self) -> None:
        """Drops the reference to the parameters (before a train step donates them)."""
        self.state, self.layers = None, None

    def _params(self) -> nnx.State:
        """The parameters to run with; a clear error when there are none or a train step has
        donated them (JAX would otherwise be handed freed buffers)."""
        if self.state is None:
            raise RuntimeError("the sampler holds no parameters (released before a train step; "
                               "hand them over with set_params)")
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.state)):
            raise RuntimeError("the sampler's parameters were deleted: a train step donated "
                               "them (release them before the step, hand the new ones over)")
        return self.state

    def _scope(self):
        return jax.set_mesh(self.mesh) if self.mesh is not None else \
            contextlib.nullcontext()

    # -------------------------------------------------------------- prefill
    def _prefill(self, todo: list, score: bool = False, cap: int = 0, pad_to: int = 0) -> list:
        """Writes seq.tokens[seq.fed:upto] of every (seq, upto) of `todo`, several sequences
        per call (rows padded to a power of two, at most `max_prefill_rows`), in chunks of at
        most `cap` (default `max_chunk`) tokens padded to a bucket of at least `pad_to`.
        Returns, if `score`, [(real tokens, `Scores`)] per chunk (one sequence only)."""
        cap, state = cap or self.cfg.max_chunk, self._params()
        swaps = []
        for seq, upto in todo:
            swaps += self.pages.private(seq, seq.fed)
            self.pages.reserve(seq, upto)
        if swaps:
            self._copy([s for s, _ in swaps], [d for _, d in swaps], [], [])
        got, M, R = [], self.spec.max_pages, max(self.spec.ring_pages, 1)
        while True:
            rows = [(seq, upto) for seq, upto in todo if seq.fed < upto]
            if not rows:
                return got
            for at in range(0, len(rows), self.cfg.max_prefill_rows):
                group = rows[at:at + self.cfg.max_prefill_rows]
                P = 1 << (len(group) - 1).bit_length()
                n = [min(cap, upto - seq.fed) for seq, upto in group]
                N = _bucket(max(max(n), pad_to), max(cap, pad_to))
                toks, pages = np.zeros((P, N), np.int32), np.zeros((P, M), np.int32)
                ring, start, count = (np.zeros((P, R), np.int32), np.zeros((P,), np.int32),
                                      np.zeros((P,), np.int32))
                for i, ((seq, _), k) in enumerate(zip(group, n, strict=True)):
                    toks[i, :k] = seq.tokens[seq.fed:seq.fed + k]
                    pages[i, :len(seq.pages)], ring[i, :len(seq.ring)] = seq.pages, seq.ring
                    start[i], count[i] = seq.fed, k
                chunk = Chunk(*(jnp.asarray(a) for a in (toks, start, count, pages, ring)))
                with self._scope():
                    self.cache, sc = programs.prefill(
                        self.graphdef, state, self.cache, chunk, self.layers,
                        kernels=self.kernels["prefill"],
                        score=score, cache_sharding=self.cache_sharding)
                if score:
                    got.append((n[0], jax.device_get(sc)))
                for (seq, _), k in zip(group, n, strict=True):
                    seq.fed += k
                self.stats["prefill_chunks"] += 1

    def _copy(self, src: list, dst: list, rsrc: list, rdst: list) -> None:
        """Copies full pages src -> dst and ring pages rsrc -> rdst in every layer."""
        n = max(len(src), len(rsrc), 1)
        C = max(8, 1 << (n - 1).bit_length())

        def pad(a: list, fill: int) -> jax.Array:
            return jnp.asarray(list(a) + [fill] * (C - len(a)), jnp.int32)
        with self._scope():
            self.cache = cache_lib.copy_pages(
                self.cache, pad(src, 0), pad(dst, self.spec.num_pages), pad(rsrc, 0),
                pad(rdst, self.spec.num_ring_pages), sliding=self.sliding,
                pages=(self.spec.num_pages, self.spec.num_ring_pages),
                cache_sharding=self.cache_sharding)

    def _prepare(self, jobs: list) -> None:
        """The jobs' sequences, ready for their first decode step (all but one token cached):
        continuations and new prompts prefilled together, each new prompt once, then forked
        into its samples (their copies in one call)."""
        bases = {}
        for job in jobs:
            if job.seq is None and id(job.prefix) not in bases:
                bases[id(job.prefix)] = self.pages.new(self._new_id(), job.prefix["tokens"])
        todo = [(j.seq, len(j.seq.tokens) - 1) for j in jobs if j.seq is not None]
        self._prefill(todo + [(b, len(b.tokens) - 1) for b in bases.values()])
        src, dst, rsrc, rdst = [], [], [], []
        for key, base in bases.items():
            prefix = next(j.prefix for j in jobs if id(j.prefix) == key)
            seqs = [base]
            for _ in range(len(prefix["jobs"]) - 1):
                fork, copies, ring = self.pages.fork(base, self._new_id())
                seqs.append(fork)
                self.stats["forks"] += 1
                src += [s for s, _ in copies]
                dst += [d for _, d in copies]
                rsrc += [s for s, _ in ring]
                rdst += [d for _, d in ring]
            for j, seq in zip(prefix["jobs"], seqs, strict=True):
                j.seq = seq
                self.seqs[seq.id] = seq
        if src or rsrc:
            self._copy(src, dst, rsrc, rdst)

    def _new_id(self) -> str:
        return f"j{next(self._ids)}"

    # -------------------------------------------------------------- generate
    def generate(self, works: Seq[Work]) -> list:
        """Runs every sample of `works` to its end (continuous batching); returns per work its
        `Turn`s in sample order. Raises KeyError for an unknown sequence, ValueError for a
        sequence that fills `max_len` (each naming the work) before anything runs."""
        continued = [w.sequence for w in works if w.sequence is not None]
        if len(set(continued)) < len(continued):
            raise ValueError("a live sequence is continued twice in one call")
        for i, w in enumerate(works):
            if w.sequence is not None and w.sequence not in self.seqs:
                raise KeyError(f"work {i}: no live sequence {w.sequence!r} (cancelled?)")
            if w.sequence is not None and len(w.params) != 1:
                raise ValueError(f"work {i}: a continuation draws one sample")
            if w.sequence is None and not w.tokens:
                raise ValueError(f"work {i}: an empty prompt")
            if not w.params:
                raise ValueError(f"work {i}: no sample asked for")
            held = len(self.seqs[w.sequence].tokens) if w.sequence is not None else 0
            if held + len(w.tokens) >= self.cfg.max_len:
                raise ValueError(f"work {i}: {held + len(w.tokens)} tokens fill the context "
                                 f"(max_len {self.cfg.max_len})")
            bad = [t for t in w.tokens if not 0 <= int(t) < self.model_cfg.vocab_size]
            if bad:
                raise ValueError(f"work {i}: token ids {bad[:4]} outside the vocabulary "
                                 f"[0, {self.model_cfg.vocab_size})")
        jobs: list = []
        for i, w in enumerate(works):
            prefix = {"tokens": [int(t) for t in w.tokens], "jobs": []}
            for j, p in enumerate(w.params):
                job = _Job(i, j, p, prefix)
                if w.sequence is not None:
                    job.seq = self.seqs[w.sequence]
                    job.seq.tokens += prefix["tokens"]
                prefix["jobs"].append(job)
                jobs.append(job)
        self._run(deque(jobs))
        out = [[] for _ in works]
        for job in jobs:
            out[job.work].append(job.out)
        return out

    def _run(self, queue: deque) -> None:
        S = self.cfg.slots
        running: list = [None] * S
        while queue or any(running):
            free = [s for s in range(S) if running[s] is None]
            admitted = [queue.popleft() for _ in range(min(len(free), len(queue)))]
            if admitted:
                self.stats["joined_running"] += len(admitted) * any(
                    r is not None and r[0].out.tokens for r in running)
                self._prepare(admitted)
            for s, job in zip(free, admitted, strict=False):
                budget = min(job.params.max_tokens, self.cfg.max_len - len(job.seq.tokens))
                job.out = Turn([], [], [], np.zeros((0, self.model_cfg.num_moe_layers,
                                                     self.model_cfg.top_k), np.int32),
                               "length", job.seq.id)
                running[s] = (job, budget)
            self._decode(running)

    def _slots(self, running: list) -> programs.Slots:
        S, M, X = self.cfg.slots, self.spec.max_pages, self.cfg.max_stops
        X = max([X] + [len(j.params.stop) for j, _ in filter(None, running)])
        a = {k: np.zeros((S,), np.int32) for k in ("token", "pos", "budget", "top_k", "count")}
        seed, temp, top_p = np.zeros((S,), np.uint32), np.ones((S,), np.float32), \
            np.ones((S,), np.float32)
        active = np.zeros((S,), bool)
        pages = np.zeros((S, M), np.int32)
        ring = np.zeros((S, max(self.spec.ring_pages, 1)), np.int32)
        stops = np.full((S, X), -1, np.int32)
        for s, item in enumerate(running):
            if item is None:
                continue
            job, budget = item
            seq, p = job.seq, job.params
            self.pages.reserve(seq, seq.fed + min(self.cfg.decode_steps, budget))
            a["token"][s], a["pos"][s], a["budget"][s] = seq.tokens[seq.fed], seq.fed, budget
            a["top_k"][s], a["count"][s] = p.top_k, len(job.out.tokens)
            seed[s], temp[s], top_p[s], active[s] = p.seed % 2**32, p.temperature, p.top_p, True
            pages[s, :len(seq.pages)] = seq.pages
            ring[s, :len(seq.ring)] = seq.ring
            stops[s, :len(p.stop)] = p.stop
        return programs.Slots(
            token_S=a["token"], pos_S=a["pos"], active_S=active, budget_S=a["budget"],
            pages_SxM=pages, ring_SxR=ring, temperature_S=temp, top_k_S=a["top_k"],
            top_p_S=top_p, seed_S=seed, count_S=a["count"], stops_SxX=stops)

    def _decode(self, running: list) -> None:
        slots = jax.tree.map(jnp.asarray, self._slots(running))
        with self._scope():
            self.cache, gen, after = programs.decode(
                self.graphdef, self._params(), self.cache, slots, self.layers,
                kernels=self.kernels["decode"], steps=self.cfg.decode_steps,
                cache_sharding=self.cache_sharding)
        gen, active = jax.device_get((gen, after.active_S))
        self.stats["decode_calls"] += 1
        for s, item in enumerate(running):
            if item is None:
                continue
            job, budget = item
            n = int(gen.valid_TxS[:, s].sum())
            toks = gen.token_TxS[:n, s].tolist()
            job.out.tokens += toks
            job.out.raw += gen.raw_TxS[:n, s].tolist()
            job.out.processed += gen.processed_TxS[:n, s].tolist()
            job.out.routed = np.concatenate([job.out.routed, gen.routed_TxSxLxK[:n, s]])
            job.seq.tokens += toks
            job.seq.fed += n
            if active[s]:
                running[s] = (job, budget - n)
            else:
                job.out.finish = "stop" if toks and toks[-1] in job.params.stop else "length"
                running[s] = None
                self.stats["finished"] += 1

    # -------------------------------------------------------------- other calls
    def score(self, tokens: Seq[int], pad_to: int = 0) -> dict:
        """Teacher forcing through the paged prefill (one chunk of at least `pad_to`, whatever
        `max_chunk`): per position i < len - 1 the argmax, the raw log-prob of tokens[i + 1]
        and the experts of position i ({"argmax", "logprobs", "routed"})."""
        seq = self.pages.new(self._new_id(), [int(t) for t in tokens])
        try:
            [(n, sc)] = self._prefill([(seq, len(seq.tokens))], score=True,
                                      cap=len(seq.tokens), pad_to=pad_to)
        finally:
            self.pages.drop(seq)
        return {"argmax": sc.argmax_BxN[0, :n - 1].tolist(),
                "logprobs": sc.logprob_BxN[0, :n - 1].tolist(),
                "routed": sc.routed_BxNxLxK[0, :n - 1]}

    def cancel(self, ids: Seq[str]) -> None:
        """Ends live sequences (their pages are freed); unknown ids are ignored."""
        for i in ids:
            seq = self.seqs.pop(i, None)
            if seq is not None:
                self.pages.drop(seq)
