"""The learner's teacher-forced answers for a token sequence, what engine outputs are checked
against (tests/test_engine_conformance.py, tests/test_sampler.py): one padded length, one
compile per model."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LENGTH = 64                 # one padded length for every teacher-forced pass: one compile


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def teacher(model, tokens):
    """The learner on `tokens` (padded to LENGTH; causal, so the padding is inert): per position
    i >= 1, log p(tokens[i] | before) and the argmax it would pick; per input position, the
    experts it was routed to [L][K]."""
    assert len(tokens) <= LENGTH
    logits, aux = _forward(model, jnp.asarray([list(tokens) + [0] * (LENGTH - len(tokens))]))
    lp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
    n = len(tokens)
    return {"logprobs": [float(lp[i - 1, tokens[i]]) for i in range(1, n)],
            "argmax": [int(np.argmax(lp[i - 1])) for i in range(1, n)],
            "routes": np.asarray(aux.routed_experts_BxSxLxK[0, :n - 1])}
