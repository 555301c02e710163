"""The vLLM adapter's decisions at build, without vLLM: the runners it
declines (said at INFO, nothing taken over), and a build that fails (one
WARNING, the runner as it was). The same in vLLM's own engine:
``engine_proof/`` (make test-engine) and ``vllm_proof/`` (make test-vllm)."""

import logging
from types import SimpleNamespace as NS

import pytest

from mtpstate.integrations.vllm import adapter


def _runner(**config):
    rs = NS(max_num_reqs=4, max_model_len=32)
    return NS(
        decode_query_len=1,
        req_states=rs,
        block_tables=NS(block_sizes=[16]),
        vllm_config=NS(
            model_config=NS(enable_sleep_mode=config.get("sleep", False)),
            parallel_config=NS(enable_elastic_ep=config.get("elastic_ep", False)),
        ),
    )


@pytest.mark.parametrize(
    "config, reason",
    [({"sleep": True}, "sleep mode"), ({"elastic_ep": True}, "elastic expert parallelism")],
)
def test_declined_at_build_with_one_info_line(config, reason, caplog):
    runner = _runner(**config)
    before = dict(vars(runner.req_states))
    assert reason in adapter.unsupported_reason(runner)
    with caplog.at_level(logging.INFO, logger="vllm.mtpstate"):
        assert adapter.ModelRunnerV2State.for_runner(runner) is None
        assert adapter.ModelRunnerV2State.for_runner(runner) is None
    said = [r for r in caplog.records if reason in r.getMessage()]
    assert len(said) <= 1 and all(r.levelno == logging.INFO for r in said)
    assert vars(runner.req_states) == before and "_mtpstate_live" not in vars(runner)


def test_a_runner_without_those_is_not_declined_for_them():
    assert adapter.unsupported_reason(_runner()) is None


def test_a_failed_build_warns_once_and_leaves_the_runner(caplog):
    # (a runner whose arrays mtpstate cannot take: the build fails)
    runner = _runner()
    before = dict(vars(runner.req_states))
    with caplog.at_level(logging.WARNING, logger="vllm.mtpstate"):
        assert adapter.ModelRunnerV2State.for_runner(runner) is None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "building its request state failed" in warned[0].getMessage()
    assert vars(runner.req_states) == before
    with pytest.raises(AttributeError):
        adapter.ModelRunnerV2State.for_runner(runner, fallback=False)
