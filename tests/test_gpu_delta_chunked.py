"""The chunked (64-token WY) gated delta rule on the GPU against the numpy reference, prompts
across chunk boundaries, output and updated state; the recurrent and chunked GPU forms agree.
Opt-in at run time (ATLAS_DELTA_RULE=chunked) until these pass on the device."""

from __future__ import annotations

import numpy as np
import pytest

from test_gpu_ops import Env, In, check_bound, delta_rule_args, normal, run_op
from test_gpu_ops import env as env  # noqa: F401  (the module-scoped GPU fixture)

pytestmark = pytest.mark.gpu

FLOOR = 2e-4


def _inputs(env: Env, rng: np.random.Generator, tokens: int) -> list[In | int]:
    hk, hv = env.d("linear_num_key_heads"), env.d("linear_num_value_heads")
    dk, dv = env.d("linear_key_head_dim"), env.d("linear_value_head_dim")
    a_log = np.log(rng.uniform(1, 16, size=hv)).astype(np.float32)
    return [In(normal(rng, tokens, 2 * hk * dk + hv * dv), "f32"), In(normal(rng, tokens, hv), "f32"),
            In(normal(rng, tokens, hv, scale=2), "f32"), In(a_log, "f32"), In(normal(rng, hv, scale=0.5), "f32"),
            In(normal(rng, hv, dk, dv, scale=0.1), "f32", state=True), hk]


@pytest.mark.parametrize("tokens", [2, 64, 65, 200])
def test_chunked_delta_rule_matches_the_reference(env: Env, rng: np.random.Generator, tokens: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_DELTA_RULE", "chunked")
    run_op(env, "gated_delta_rule", _inputs(env, rng, tokens), FLOOR, pack=delta_rule_args)


def test_chunked_and_recurrent_forms_agree(env: Env, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _inputs(env, rng, 150)
    results = []
    for form in ("recurrent", "chunked"):
        monkeypatch.setenv("ATLAS_DELTA_RULE", form)
        args = [env.gpu.upload(x.value, x.storage) if isinstance(x, In) else x for x in inputs]
        env.gpu.rt.reset_step()
        out = env.gpu.to_numpy(env.gpu.gated_delta_rule(*delta_rule_args(args)))
        results.append((out, env.gpu.to_numpy(args[5])))
    (out_r, state_r), (out_c, state_c) = results
    check_bound("chunked vs recurrent output", out_c, out_r, out_r, FLOOR)
    check_bound("chunked vs recurrent state", state_c, state_r, state_r, FLOOR)
