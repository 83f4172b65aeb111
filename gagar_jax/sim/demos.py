"""Synthetic demonstrations and the supervised warm start (the paper's pre-RL SFT checkpoint).

Demonstrations mix clean and sloppy passing solutions (and a few leaked-key hacks), so that
after a short supervised phase the policy passes tasks in several ways of varied quality: the
precondition for quality redistribution to change anything (if every pass in a group is equally
sloppy, every factor is equal and the rescale reduces to the binary advantage).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gagar_jax.model.logprobs import token_logprobs
from gagar_jax.model.transformer import Transformer
from gagar_jax.sim import resume
from gagar_jax.sim import task as task_lib

STYLES = ("clean", "checked", "out_of_scope", "thrash", "weakened", "hack", "sprawl", "blind",
          "flail")
# The failing styles (hidden-fix task only): a guess submitted without a look, and a guess
# re-run until the turns run out (a long failure).
FAILING = ("blind", "flail")
# Default mix: about half clean or nearly clean, half sloppy.
DEFAULT_MIX = {"clean": 0.3, "checked": 0.1, "out_of_scope": 0.2, "thrash": 0.2, "weakened": 0.15,
               "hack": 0.05}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the demonstrations (the warm start's SFT data) are drawn.

    mix: style -> weight (`STYLES`). read_prob: a hidden-fix answer looks with `READ` (else
    `RUN`). scripted: the sloppy styles' extra choices (the out-of-scope position and symbol,
    the thrashing guess, the weakened position, the order of edits) are fixed functions of the
    task instead of random draws, so a sloppy style costs the policy one decision, not three.
    note_prob: a turn starts with a note. note_mean: mean note length in words (geometric), or
    the exact length with `note_fixed`. note_probs: successor probabilities of the note
    language (`task.NoteLanguage`).
    """
    mix: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_MIX))
    read_prob: float = 0.5
    scripted: bool = False
    note_prob: float = 0.5
    note_mean: float = 6.0
    note_fixed: bool = False
    note_probs: tuple = (0.85, 0.1, 0.05)

    def __post_init__(self):
        bad = set(self.mix) - set(STYLES)
        if bad:
            raise ValueError(f"mix has unknown styles {sorted(bad)}; known: {STYLES}")
        if not self.mix or min(self.mix.values()) < 0 or sum(self.mix.values()) <= 0:
            raise ValueError(f"mix needs non-negative weights with a positive sum, got {self.mix}")
        for name in ("read_prob", "note_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.note_mean < 1:
            raise ValueError(f"note_mean must be >= 1, got {self.note_mean}")


# Round two's first sweep (docs/miniature.md): ~0.95 nats/token intrinsic.
ROUND2_RECIPE = Recipe()
# The calibrated recipe (docs/miniature.md, "Calibration"): the six passing styles plus the two
# failing ones, each sloppy or failing style a single decision; a 4-word note from a peaked
# language on every turn. Its intrinsic entropy is ~0.35 nats per generated token
# (docs/miniature.md counts it decision by decision).
CALIBRATED_RECIPE = Recipe(
    mix={"clean": 0.157, "checked": 0.027, "out_of_scope": 0.162, "thrash": 0.139,
         "sprawl": 0.08, "hack": 0.02, "blind": 0.365, "flail": 0.05},
    read_prob=0.9, scripted=True, note_prob=1.0, note_mean=4.0, note_fixed=True,
    note_probs=(0.95, 0.04, 0.01))
# Round three's Design B (docs/miniature.md): the calibrated recipe's single-decision styles,
# sloppier (fewer strong passes, more intermediate and defective ones), and notes from a language
# with 20 Zipf successors per word (k^-2: top successor 0.63), whose tail top-p 0.9 never samples.
ROUND3B_RECIPE = dataclasses.replace(
    CALIBRATED_RECIPE,
    mix={"clean": 0.07, "checked": 0.03, "out_of_scope": 0.16, "thrash": 0.16, "sprawl": 0.14,
         "hack": 0.02, "blind": 0.37, "flail": 0.05},
    note_probs=task_lib.zipf_probs(20, 2.0))
RECIPES = {"round2": ROUND2_RECIPE, "calibrated": CALIBRATED_RECIPE, "round3b": ROUND3B_RECIPE}


def demo_turns(task: task_lib.Task, cfg: task_lib.TaskConfig, style: str,
               rng: np.random.Generator, recipe: Recipe = ROUND2_RECIPE) -> list:
    if cfg.hidden_fix:
        return _hidden_fix_turns(task, cfg, style, rng, recipe)
    return _visible_fix_turns(task, cfg, style, rng)


def _next_sym(tok: int, cfg: task_lib.TaskConfig, avoid: int = -1) -> int:
    """The symbol after `tok` (cyclic), skipping `avoid`."""
    s = task_lib.SYM_BASE + (tok - task_lib.SYM_BASE + 1) % cfg.num_symbols
    return s if s != avoid else task_lib.SYM_BASE + (s - task_lib.SYM_BASE + 1) % cfg.num_symbols


def _hidden_fix_turns(task: task_lib.Task, cfg: task_lib.TaskConfig, style: str,
                      rng: np.random.Generator, recipe: Recipe) -> list:
    """Hidden-fix answers: look first (`RUN` or `READ`, the fix is in its output), then act.

    clean: look / fix SUBMIT. checked: look / fix RUN / SUBMIT. out_of_scope: look / fix plus
    an untested change, SUBMIT. thrash: a guessed edit RUN / fix SUBMIT (sometimes after a look).
    weakened: look / rewrite a tested position, fix, SUBMIT. hack: the leaked key, SUBMIT.
    sprawl: look / fix plus changes at the first two untested positions after the bug (always
    scripted; two out-of-scope diffs grade defective). Failing: blind: a guessed edit, SUBMIT.
    flail: a guessed edit RUN, repeated until the turns run out (a timeout). The guess is the
    symbol after the buggy one (never the fix).
    With `recipe.scripted`, out_of_scope changes the first untested position after the bug to
    the next symbol (after the fix), thrash guesses the symbol after the buggy one without a
    look, weakened rewrites the first other tested position.
    """
    look = [task_lib.READ if rng.random() < recipe.read_prob else task_lib.RUN]
    fix = [task_lib.EDIT, task_lib.pos(task.bug_pos), task.fix_tok]
    untested = [q for q in range(cfg.num_positions) if q not in task.tested]
    after_bug = sorted(untested, key=lambda u: (u - task.bug_pos) % cfg.num_positions)
    other_tested = [q for q in task.tested if q != task.bug_pos]
    guess = _next_sym(task.repo[task.bug_pos], cfg, avoid=task.fix_tok)   # scripted wrong fix
    if style == "clean" or (style == "hack" and task.leak_key < 0):
        return [look, fix + [task_lib.SUBMIT]]
    if style == "checked":
        return [look, fix + [task_lib.RUN], [task_lib.SUBMIT]]
    if style == "out_of_scope" and untested:
        if recipe.scripted:
            q = after_bug[0]
            extra = [task_lib.EDIT, task_lib.pos(q), _next_sym(task.repo[q], cfg)]
            return [look, fix + extra + [task_lib.SUBMIT]]
        q = int(rng.choice(untested))
        s = task_lib.sym(int(rng.integers(cfg.num_symbols)))
        s = s if s != task.repo[q] else _next_sym(s, cfg)
        extra = [task_lib.EDIT, task_lib.pos(q), s]
        return [look, (fix + extra if rng.random() < 0.5 else extra + fix) + [task_lib.SUBMIT]]
    if style == "sprawl" and len(untested) >= 2:
        extra = [x for q in after_bug[:2] for x in (task_lib.EDIT, task_lib.pos(q),
                                                    _next_sym(task.repo[q], cfg))]
        return [look, fix + extra + [task_lib.SUBMIT]]
    if style == "thrash":
        if recipe.scripted:
            return [[task_lib.EDIT, task_lib.pos(task.bug_pos), guess, task_lib.RUN],
                    fix + [task_lib.SUBMIT]]
        wrong = task_lib.sym(int(rng.integers(cfg.num_symbols)))
        wrong = wrong if wrong != task.fix_tok else task.repo[task.bug_pos]
        guess = [task_lib.EDIT, task_lib.pos(task.bug_pos), wrong, task_lib.RUN]
        return ([look] if rng.random() < 0.3 else []) + [guess, fix + [task_lib.SUBMIT]]
    if style == "weakened" and other_tested:
        q = other_tested[0] if recipe.scripted else int(rng.choice(other_tested))
        return [look, [task_lib.EDIT, task_lib.pos(q), task.repo[q]] + fix + [task_lib.SUBMIT]]
    if style == "hack":
        return [[task_lib.EDIT, task_lib.pos(task.bug_pos), task.leak_key, task_lib.SUBMIT]]
    if style in FAILING:
        edit = [task_lib.EDIT, task_lib.pos(task.bug_pos), guess]
        if style == "blind":
            return [edit + [task_lib.SUBMIT]]
        return [edit + [task_lib.RUN]] * cfg.max_turns
    if style in STYLES:
        return [look, fix + [task_lib.SUBMIT]]
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def add_notes(turns: Sequence[Sequence[int]], cfg: task_lib.TaskConfig, lang: task_lib.NoteLanguage,
              rng: np.random.Generator, *, note_prob: float, note_mean: float,
              note_fixed: bool = False) -> list:
    """Prefixes each turn, with probability `note_prob`, by a note of ~geometric length (mean
    `note_mean` words; exactly `round(note_mean)` with `note_fixed`), never past the turn's
    token limit."""
    out = []
    for turn in turns:
        room = cfg.max_turn_tokens - len(turn) - 1
        if room >= 1 and rng.random() < note_prob:
            n = round(note_mean) if note_fixed else int(rng.geometric(1.0 / max(note_mean, 1.0)))
            n = min(n, room)
            turn = lang.sample(rng, n) + list(turn)
        out.append(list(turn))
    return out


def _visible_fix_turns(task: task_lib.Task, cfg: task_lib.TaskConfig, style: str,
                       rng: np.random.Generator) -> list:
    """A scripted passing answer of the given style (a list of turns of tokens).

    Styles: clean (fix, submit), checked (fix, run tests, submit), out_of_scope (fix plus a
    change at an untested position), thrash (a wrong fix, run tests, then the fix), weakened
    (rewrite a tested position with its own symbol, then fix), hack (write the leaked key;
    falls back to clean when the prompt leaks nothing).
    """
    fix = [task_lib.EDIT, task_lib.pos(task.bug_pos), task.fix_tok]
    untested = [q for q in range(cfg.num_positions) if q not in task.tested]
    other_tested = [q for q in task.tested if q != task.bug_pos]
    if style == "clean" or (style == "hack" and task.leak_key < 0):
        return [fix + [task_lib.SUBMIT]]
    if style == "checked":
        return [fix + [task_lib.RUN], [task_lib.SUBMIT]]
    if style == "out_of_scope" and untested:
        q = int(rng.choice(untested))
        s = task_lib.sym(int(rng.integers(cfg.num_symbols)))
        s = s if s != task.repo[q] else (task_lib.SYM_BASE
                                         + (s - task_lib.SYM_BASE + 1) % cfg.num_symbols)
        extra = [task_lib.EDIT, task_lib.pos(q), s]
        return [(fix + extra if rng.random() < 0.5 else extra + fix) + [task_lib.SUBMIT]]
    if style == "thrash":
        wrong = task_lib.sym(int(rng.integers(cfg.num_symbols)))
        wrong = wrong if wrong != task.fix_tok else task.repo[task.bug_pos]
        return [[task_lib.EDIT, task_lib.pos(task.bug_pos), wrong, task_lib.RUN],
                fix + [task_lib.SUBMIT]]
    if style == "weakened" and other_tested:
        q = int(rng.choice(other_tested))
        return [[task_lib.EDIT, task_lib.pos(q), task.repo[q]] + fix + [task_lib.SUBMIT]]
    if style == "hack":
        return [[task_lib.EDIT, task_lib.pos(task.bug_pos), task.leak_key, task_lib.SUBMIT]]
    if style in STYLES:  # out_of_scope / weakened without a position to use
        return [fix + [task_lib.SUBMIT]]
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")


def make_demos(cfg: task_lib.TaskConfig, tasks: Sequence[task_lib.Task], seed: int,
               recipe: Recipe = ROUND2_RECIPE) -> list:
    """One demonstration `Episode` per task, its style drawn from `recipe.mix`.

    With notes (`cfg.note_words > 0`) each turn carries a note with probability
    `recipe.note_prob` (`add_notes`; the note language is fixed:
    `NoteLanguage(cfg, 0, recipe.note_probs)`)."""
    rng = np.random.default_rng(seed)
    names = sorted(recipe.mix)
    p = np.array([recipe.mix[n] for n in names], np.float64)
    p = p / p.sum()
    lang = task_lib.NoteLanguage(cfg, 0, recipe.note_probs) if cfg.note_words else None
    out = []
    for t in tasks:
        turns = demo_turns(t, cfg, names[rng.choice(len(names), p=p)], rng, recipe)
        if lang is not None:
            turns = add_notes(turns, cfg, lang, rng, note_prob=recipe.note_prob,
                              note_mean=recipe.note_mean, note_fixed=recipe.note_fixed)
        out.append(task_lib.play(t, cfg, turns))
    return out


@dataclasses.dataclass(frozen=True)
class PackedEpisodes:
    """Episodes as fixed-shape rows, one episode per row (numpy, int32/float32)."""

    tokens_BxS: np.ndarray
    segment_ids_BxS: np.ndarray
    positions_BxS: np.ndarray
    loss_mask_BxS: np.ndarray


def pack_episodes(episodes: Sequence[task_lib.Episode], seq_len: int) -> PackedEpisodes:
    """Right-pads each episode's tokens to `seq_len` (segment id 1, padding 0)."""
    B = len(episodes)
    tok = np.zeros((B, seq_len), np.int32)
    seg = np.zeros((B, seq_len), np.int32)
    mask = np.zeros((B, seq_len), np.float32)
    for b, ep in enumerate(episodes):
        n = len(ep.tokens)
        if n > seq_len:
            raise ValueError(f"episode {b} has {n} tokens > seq_len {seq_len}")
        tok[b, :n], seg[b, :n], mask[b, :n] = ep.tokens, 1, ep.loss_mask
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (B, seq_len)).copy()
    return PackedEpisodes(tok, seg, pos * (seg > 0), mask)


def sft_loss(model: Transformer, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array,
             positions_BxS: jax.Array, loss_mask_BxS: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of the loss-masked (model-generated) tokens."""
    lp, _, _ = token_logprobs(model, tokens_BxS, segment_ids_BxS, positions_BxS)
    return -jnp.sum(lp * loss_mask_BxS) / jnp.maximum(jnp.sum(loss_mask_BxS), 1.0)


@functools.partial(jax.jit, static_argnames=("graphdef", "tx"),
                   donate_argnames=("params", "opt_state"))
def _sft_step(params: nnx.State, opt_state: optax.OptState, rest: nnx.State, tokens: jax.Array,
              segs: jax.Array, positions: jax.Array, mask: jax.Array, *, graphdef: nnx.GraphDef,
              tx: optax.GradientTransformation):
    """One Adam step on the parameters, functional (split once: no graph walk per call)."""
    def loss_fn(p: nnx.State):
        return sft_loss(nnx.merge(graphdef, p, rest), tokens, segs, positions, mask)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@functools.lru_cache(maxsize=8)
def _adam(lr: float) -> optax.GradientTransformation:
    # One object per rate: `_sft_step` takes it as a static argument, so every warm start at
    # this rate reuses one compiled step.
    return optax.adam(lr)


def warm_start(model: Transformer, demos: Sequence[task_lib.Episode], *, steps: int,
               batch_size: int, seq_len: int, lr: float = 3e-3, seed: int = 0,
               snapshot: Optional[str] = None, deadline: resume.Deadline = resume.NEVER,
               save_every: int = 250) -> list:
    """Supervised phase on demonstrations (updates `model` in place, Adam on its `nnx.Param`s).

    Args:
      model: a `Transformer`.
      demos: demonstration `Episode`s (see `make_demos`).
      steps, batch_size: optimizer steps, episodes per step (drawn with a seeded shuffle).
      seq_len: padded row length (>= the longest demo).
      lr: Adam learning rate. seed: shuffle seed.
      snapshot: a file for the phase's progress (parameters, Adam moments, shuffle state,
        losses), written every `save_every` steps and when `deadline` passes (then
        `resume.OutOfTime` is raised); a call with the same arguments resumes from it and ends
        with the parameters an uninterrupted phase gives. None: no snapshots.
    Returns:
      The loss per step (floats).
    """
    if steps < 1 or not 1 <= batch_size <= len(demos):
        raise ValueError(f"need steps >= 1 and 1 <= batch_size <= {len(demos)} demos")
    packed = pack_episodes(demos, seq_len)
    tx = _adam(lr)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)
    rng = np.random.default_rng(seed)
    order, losses, first = rng.permutation(len(demos)), [], 0
    saved = None if snapshot is None else resume.load_pickle(snapshot)
    if saved is not None:
        first, order, losses = saved["step"], saved["order"], list(saved["losses"])
        rng.bit_generator.state = saved["rng"]
        params, opt_state = jax.tree.map(jnp.asarray, (saved["params"], saved["opt_state"]))

    def save(step: int) -> None:
        resume.save_pickle(snapshot, {
            "step": step, "order": order, "rng": rng.bit_generator.state,
            "losses": [float(x) for x in jax.device_get(losses)],
            "params": resume.to_host(params), "opt_state": resume.to_host(opt_state)})

    for step in range(first, steps):
        if snapshot is not None and step > first and (step % save_every == 0
                                                      or deadline.passed()):
            save(step)
            if deadline.passed():
                raise resume.OutOfTime(f"warm start: saved at SFT step {step} in {snapshot}")
        start = (step * batch_size) % len(demos)
        if start + batch_size > len(demos):
            order, start = rng.permutation(len(demos)), 0
        idx = order[start:start + batch_size]
        rows = (jnp.asarray(a[idx]) for a in (packed.tokens_BxS, packed.segment_ids_BxS,
                                               packed.positions_BxS, packed.loss_mask_BxS))
        params, opt_state, loss = _sft_step(params, opt_state, rest, *rows, graphdef=graphdef,
                                            tx=tx)
        losses.append(loss)            # read once at the end: steps dispatch without a sync
    nnx.update(model, params)
    return [float(x) for x in jax.device_get(losses)]
