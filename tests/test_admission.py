"""The admission policy (engine/admission.py): a request is admitted whole or refused whole."""

from specray.engine.admission import AdmissionPolicy, Load, RequestCost
from specray.serve.config import ServeConfig


def test_over_the_per_request_limit_is_a_400_whatever_the_load():
    policy = AdmissionPolicy(max_sequences_per_request=4096, max_waiting_sequences=8)
    assert policy.check(RequestCost.of([3] * 2048, n=2)).admitted  # OpenAI's 2,048 prompts, n=2
    no = policy.admit(RequestCost.of([3] * 2049, n=2), Load())
    assert (no.admitted, no.status, no.param, no.retry_after_s) == (False, 400, "prompt", None)
    assert "4098 sequences" in no.message and "max_sequences_per_request" in no.message


def test_a_full_queue_is_a_503_with_retry_after_and_an_empty_one_takes_anything_allowed():
    policy = AdmissionPolicy(max_sequences_per_request=4096, max_waiting_sequences=8)
    big = RequestCost.of([5] * 2048, n=1)
    assert policy.admit(big, Load(waiting=0, running=8)).admitted  # nothing waits: taken whole
    assert policy.admit(RequestCost(3), Load(waiting=5, running=8)).admitted  # 5 + 3 fit the queue
    busy = policy.admit(RequestCost(4), Load(waiting=5, running=8))
    assert (busy.admitted, busy.status, busy.kind, busy.retry_after_s) == (False, 503, "overloaded", 1.0)


def test_the_server_config_carries_the_policy_and_its_flags():
    from specray.entrypoints.flags import config_data

    class Args:
        max_sequences_per_request, max_waiting_sequences, graceful_shutdown_s = 100, 7, 5.0

    cfg = ServeConfig.model_validate(config_data(Args(), {}))
    policy = cfg.admission_policy()
    assert (policy.max_sequences_per_request, policy.max_waiting_sequences, cfg.graceful_shutdown_s) == (100, 7, 5.0)
