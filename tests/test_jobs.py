"""The batch job entrypoint (specray.entrypoints.jobs): in-process on tiny models (the
session's ``ray_session`` from conftest), and end to end through a real
``ray start --head`` + ``JobSubmissionClient``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import hf_greedy

from specray.entrypoints import jobs

MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tiny_pair, tiny_checkpoints):
    """(target model in memory, a YAML config naming the saved tiny target, draft, Medusa, EAGLE,
    DFlash and DSpark heads)."""
    from tests.test_dflash import random_drafter
    from tests.test_dspark import random_dspark
    from tests.test_eagle import random_head
    from tests.test_medusa import random_heads

    root = tmp_path_factory.mktemp("jobs")
    random_heads().save(root / "medusa")
    random_head(tiny_pair[0]).save(root / "eagle")
    random_drafter(tiny_pair[0]).save(root / "dflash", num_target_layers=2)
    random_dspark(tiny_pair[0]).save(root / "dspark", num_target_layers=2)
    config = root / "specray.yaml"
    config.write_text(
        f"target: {tiny_checkpoints['target']}\n"
        f"draft: {tiny_checkpoints['draft']}\n"
        f"medusa: {root / 'medusa'}\n"
        f"checkpoints:\n  eagle: {root / 'eagle'}\n  dflash: {root / 'dflash'}\n  dspark: {root / 'dspark'}\n"
        f"max_num_seqs: {MAX_NUM_SEQS}\n"
        "default_speculation:\n  method: draft\n  num_speculative_tokens: 3\n"
        "placement:\n  timeout_s: 60\n"
    )
    return tiny_pair[0], config


def _records():
    """Greedy records with different lengths, max_tokens and methods (+ ids or none)."""
    methods = [None, {"method": "none"}, {"method": "draft", "num_speculative_tokens": 2},
               {"method": "ngram", "num_speculative_tokens": 3, "max_matching_ngram_size": 2},
               {"method": "medusa"}, {"method": "medusa", "tree": "wide"},
               {"method": "eagle"}, {"method": "eagle", "dynamic_tree": True, "top_k": 3, "total_tokens": 8},
               {"method": "dflash", "num_speculative_tokens": 4}, {"method": "dspark", "num_speculative_tokens": 4}]
    recs = []
    for i in range(12):
        prompt = [(7 * i + 3 * j) % 64 for j in range(3 + i % 5)]
        if i % 3 == 0:
            prompt = prompt + prompt[:3]  # repeats, so prompt lookup finds something
        rec = {"prompt": prompt, "sampling": {"max_tokens": 4 + 3 * (i % 4), "temperature": 0}}
        if methods[i % len(methods)] is not None:
            rec["speculation"] = methods[i % len(methods)]
        if i % 2 == 0:
            rec["id"] = f"r{i}"
        recs.append(rec)
    return recs


def _write_jsonl(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _summary_from_stdout(out: str) -> dict:
    for line in reversed(out.splitlines()):
        if line.startswith("{") and '"prompts_total"' in line:
            return json.loads(line)
    raise AssertionError(f"no summary line in stdout:\n{out}")


def _assert_resources_back(ray, timeout_s: float = 120.0) -> None:
    """The job's coordinator, workers and placement group are gone: all GPUs free again."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources().get("GPU", 0):
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def _run_in_process(argv: list[str], ray, capsys) -> tuple[dict, str]:
    """``jobs.main(argv)`` in this process, which succeeds and gives its resources back: (its
    summary, the output file's text)."""
    assert jobs.main(argv) == 0
    _assert_resources_back(ray)
    return _summary_from_stdout(capsys.readouterr().out), Path(argv[argv.index("--output") + 1]).read_text()


def _sampled_records():
    """No sampling given: SamplingParams() (16 tokens, temperature 1); seeded samples repeat."""
    seeded = {"prompt": [4, 5], "sampling": {"max_tokens": 7, "seed": 3, "temperature": 1.0}}
    return [{"prompt": [1, 2, 3], "id": 7}, seeded, seeded, {**seeded, "speculation": {"method": "none"}}]


def _check_sampled(lines: list[dict]) -> None:
    assert [len(o["token_ids"]) for o in lines] == [16, 7, 7, 7]
    assert lines[0]["id"] == 7 and lines[1]["id"] is None
    assert lines[1]["token_ids"] == lines[2]["token_ids"]  # same seed, same method: same sample
    assert lines[0]["metrics"]["num_drafts"] > 0 and lines[3]["metrics"]["num_drafts"] == 0


def _check_output(lines: list[dict], recs, target) -> None:
    assert [o["index"] for o in lines] == list(range(len(recs)))
    for o, r in zip(lines, recs):
        n = r["sampling"]["max_tokens"]
        assert o["id"] == r.get("id")
        assert o["token_ids"] == hf_greedy(target, r["prompt"], n), o
        assert len(o["token_ids"]) == n and o["finish_reason"] == "length"
        method = (r.get("speculation") or {"method": "draft"})["method"]  # default: the config's
        assert o["method"] == method  # each line says which method ran
        if method == "none":
            assert o["metrics"]["num_drafts"] == 0
        elif method in ("medusa", "eagle", "dflash", "dspark"):
            assert o["metrics"]["num_drafts"] > 0
        elif method == "draft":
            assert o["metrics"]["num_drafts"] > 0
            assert max(len(o["metrics"]["accepted_per_pos"]), 1) <= (r.get("speculation") or {}).get(
                "num_speculative_tokens", 3)


def test_job_bad_input_lines(tiny_dirs, tmp_path, capsys):
    _, config = tiny_dirs
    inp = tmp_path / "bad.jsonl"
    inp.write_text(
        '{"prompt": [1, 2, 3]}\n'                                   # 1 ok
        '{"prompt": [1, 2\n'                                        # 2 not JSON
        '\n'                                                        # 3 blank: ignored
        '{"prompt": [1], "sampling": {"max_tokens": 0}}\n'          # 4 max_tokens < 1
        '{"prompt": [1], "speculation": {"method": "medusa9"}}\n'   # 5 unknown method
        '{"prompt": [1, 999]}\n'                                    # 6 token id >= vocab
        '{"prompt": [1], "temprature": 0}\n'                        # 7 unknown field
        '[1, 2]\n'                                                  # 8 not an object
        '{"prompt": "text"}\n'                                      # 9 no tokenizer
        '{"id": "x"}\n'                                             # 10 no prompt
        '{"prompt": [1], "speculation": {"method": "medusa", "medusa_choices": [[0], [0, 0]]}}\n'  # 11 ok
        '{"prompt": [1], "speculation": {"method": "medusa", "medusa_choices": [[0, 0, 0, 0, 0]]}}\n'  # 12 deep
        '{"prompt": [1], "speculation": {"method": "eagle", "dynamic_tree": true, "tree": "chain"}}\n'  # 13
        '{"prompt": [1], "speculation": {"method": "eagle", "dynamic_tree": true}}\n'  # 14 ok
        '{"prompt": [1, 999], "speculation": {"method": "medusa", "medusa_choices": [[0, 0, 0, 0, 0]]}}\n'  # 15 two
        '{"prompt": [1], "sampling": {"max_tokens": "ten"}, "speculation": {"method": "drafft"}}\n'  # 16 two
        '{"prompt": [1], "sampling": {"structured_outputs": {"regex": "a+"}}}\n'  # 17 no tokenizer for a grammar
    )
    out = tmp_path / "out.jsonl"
    assert jobs.main(["--input", str(inp), "--output", str(out), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    for n in (2, 4, 5, 6, 7, 8, 9, 10, 12, 13, 17):
        assert f"line {n}:" in err, (n, err)
    assert "structured outputs need the model's tokenizer" in err
    assert "exceeds the 4 draft heads" in err and "dynamic_tree builds its own tree" in err
    for n in (1, 3, 11, 14):
        assert f"line {n}:" not in err
    line15 = [row for row in err.splitlines() if "line 15:" in row]  # every problem of a line, each listed
    assert len(line15) == 2 and "token ids" in line15[0] and "exceeds the 4 draft heads" in line15[1], err
    line16 = [row for row in err.splitlines() if "line 16:" in row]  # a field that does not parse hides no other
    assert len(line16) == 2 and "max_tokens" in line16[0] and "drafft" in line16[1], err
    assert "max_tokens" in err and "medusa9" in err and "temprature" in err
    assert not out.exists()


def test_job_bad_config_and_output(tiny_dirs, tmp_path, capsys):
    _, config = tiny_dirs
    inp = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1, 2]}, {"prompt": [3]}])
    bad_cfg = tmp_path / "bad.json"
    bad_cfg.write_text('{"target": "/x", "max_num_seqs": 0}')
    assert jobs.main(["--input", str(inp), "--output", str(tmp_path / "o"), "--config", str(bad_cfg)]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    # An output line that is corrupt before the end is not silently dropped.
    out = tmp_path / "o.jsonl"
    out.write_text('garbage\n{"index": 1, "id": null}\n')
    assert jobs.main(["--input", str(inp), "--output", str(out), "--config", str(config)]) == 2
    assert "line 1" in capsys.readouterr().err
    assert jobs.main(["--input", str(inp), "--output", str(out), "--batch-size", "0"]) == 2


def test_a_serve_config_with_vllm_names_configures_a_job(tiny_checkpoints, tmp_path):
    """The serve config's flat names work for a job too (its server settings do not apply)."""
    target = tiny_checkpoints["target"]
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"target: {target}\nmax-model-len: 128\nmax-num-seqs: 2\nport: 9999\nserved-model-name: x\n"
                   'speculative-config: {"method": "ngram", "num_speculative_tokens": 2}\n')
    config = jobs.load_config(str(cfg))
    assert (config.target, config.max_model_len, config.max_num_seqs) == (target, 128, 2)
    assert config.default_speculation.method == "ngram" and config.default_speculation.num_speculative_tokens == 2
    cfg.write_text("max-model-len: 1\n")
    with pytest.raises(jobs.UsageError, match="max_model_len"):
        jobs.load_config(str(cfg))


# -- end to end: ray start --head + ray job submission -------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture()
def ray_head():
    """A head node of our own: own temp dir, ports and token; stopped by its process group."""
    temp_dir = tempfile.mkdtemp(prefix="sr-", dir="/tmp")  # short: Unix socket paths < 108 chars
    token = secrets.token_hex(32)
    token_path = os.path.join(temp_dir, "auth_token")
    with open(token_path, "w") as f:
        f.write(token)
    (gcs, dash, client, nm, om, metrics, agent, agent_grpc, rte) = _free_ports(9)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token_path, RAY_USAGE_STATS_ENABLED="0",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", SPECRAY_WORKER_THREADS="1")
    # `ray start` with this interpreter: the cluster's workers then import this checkout.
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--temp-dir", os.path.join(temp_dir, "ray"),
           "--port", str(gcs), "--dashboard-port", str(dash), "--dashboard-host", "127.0.0.1",
           "--ray-client-server-port", str(client), "--node-manager-port", str(nm),
           "--object-manager-port", str(om), "--metrics-export-port", str(metrics),
           "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
           "--runtime-env-agent-port", str(rte), "--num-cpus", "4", "--num-gpus", "2",
           "--disable-usage-stats"]
    log_path = os.path.join(temp_dir, "head.log")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield {"url": f"http://127.0.0.1:{dash}", "token": token, "proc": proc, "log": log_path}
    finally:
        _stop_session(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of a session, from /proc: the head we started with
    ``start_new_session=True`` and all its descendants (Ray workers get process groups
    of their own, but stay in the session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop_session(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM every process of the head's session (gcs, raylet, dashboard, workers),
    give them ``grace_s`` to exit, then SIGKILL what is left (``ray start --block``
    itself ignores SIGTERM, and a raylet can take long). Never ``ray stop``."""
    sid = proc.pid
    _signal_all(_session_members(sid), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and [p for p in _session_members(sid) if p != sid]:
        time.sleep(0.2)
    for _ in range(3):
        left = _session_members(sid)
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.5)
    proc.wait(timeout=30)


def _job_client(head, timeout_s: float = 90.0):
    from ray.job_submission import JobSubmissionClient

    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if head["proc"].poll() is not None:
            break
        try:
            return JobSubmissionClient(head["url"], headers={"Authorization": f"Bearer {head['token']}"})
        except Exception as exc:  # not up yet
            last = exc
            time.sleep(1)
    raise AssertionError(f"dashboard at {head['url']} did not answer: {last}\n{Path(head['log']).read_text()}")


def _submit(client, entrypoint: str, timeout_s: float = 120.0) -> str:
    """Submit once the head's job agent is up (the dashboard answers before it does: "No
    available agent to submit job"; a loaded head may also drop the connection). Every try
    names the same submission id, so a try whose answer was lost is not a second job."""
    import requests

    submission_id = f"specray-test-{secrets.token_hex(4)}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, submission_id=submission_id)
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                raise
        except RuntimeError as exc:
            if "already exists" in str(exc):  # an earlier try went through
                return submission_id
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(1)


@pytest.mark.slow  # starts processes: a Ray head of its own
def test_job_order_greedy_and_resume_through_job_submission(ray_session, ray_head, tiny_dirs, tmp_path, capsys,
                                                            monkeypatch):
    """In process (the session's Ray): every line in input order, greedy equal to HF, each naming
    its method, and the summary. A crash then loses the last two lines and tears a third; the
    resume runs as a job submitted to a head of our own (``JobSubmissionClient``) and generates
    only those three: the file ends as the uninterrupted run left it. Run again, a finished job
    starts nothing and keeps its summary."""
    from ray.job_submission import JobStatus

    target, config = tiny_dirs
    sampled, recs = _sampled_records(), _records()
    inp = _write_jsonl(tmp_path / "prompts.jsonl", sampled + recs)
    out = tmp_path / "out.jsonl"
    argv = ["--input", str(inp), "--output", str(out), "--config", str(config), "--batch-size", "3"]

    summary, text = _run_in_process(argv, ray_session, capsys)
    all_lines = [json.loads(x) for x in text.splitlines()]
    assert [o["index"] for o in all_lines] == list(range(len(sampled) + len(recs)))
    _check_sampled(all_lines[: len(sampled)])
    lines = [{**o, "index": o["index"] - len(sampled)} for o in all_lines[len(sampled):]]
    _check_output(lines, recs, target)

    lines = all_lines
    total_tokens = sum(len(o["token_ids"]) for o in lines)
    assert summary == json.loads(Path(f"{out}.metrics.json").read_text())
    assert summary["prompts_total"] == summary["prompts_done"] == len(lines)
    assert summary["prompts_skipped"] == 0
    assert summary["generated_tokens"] == total_tokens
    drafts = sum(o["metrics"]["num_drafts"] for o in lines)
    accepted = sum(o["metrics"]["num_accepted_tokens"] for o in lines)
    assert summary["num_drafts"] == drafts > 0
    assert summary["num_accepted_tokens"] == accepted
    assert summary["mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    assert summary["target_forward_passes"] == sum(o["metrics"]["target_forward_passes"] for o in lines)
    assert summary["tokens_per_second"] > 0

    # A crash: the last two lines lost, a third torn mid-write. Resumed by `ray job submit`
    # (the same entrypoint in a driver of the head's cluster), in two batches of two.
    kept = text.splitlines(keepends=True)
    out.write_text("".join(kept[:-3]) + kept[-3][: len(kept[-3]) // 2])
    client = _job_client(ray_head)
    entrypoint = " ".join(shlex.quote(a) for a in [
        sys.executable, "-m", "specray.entrypoints.jobs", *argv[:-1], "2"])
    job_id = _submit(client, entrypoint)
    deadline = time.monotonic() + 900  # a readiness wait: a loaded machine starts workers slowly
    status = client.get_job_status(job_id)
    while not status.is_terminal() and time.monotonic() < deadline:
        time.sleep(1)
        status = client.get_job_status(job_id)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, f"job {job_id} ended {status}:\n{logs}"
    assert out.read_text() == text
    summary2 = json.loads(Path(f"{out}.metrics.json").read_text())
    assert _summary_from_stdout(logs) == summary2
    assert summary2["prompts_skipped"] == len(lines) - 3
    assert summary2["prompts_done"] == 3
    assert summary2["generated_tokens"] == sum(len(o["token_ids"]) for o in lines[-3:])
    assert f"{len(lines)} records, {len(lines) - 3} already in" in logs and "batch 2/2" in logs

    # Nothing left: no coordinator, no change, and the summary of the run that generated stays.
    metrics = Path(f"{out}.metrics.json").read_text()
    with monkeypatch.context() as m:
        m.setattr("specray.actors.coordinator.Coordinator", None)  # any use of it fails
        assert jobs.main(argv) == 0
    assert _summary_from_stdout(capsys.readouterr().out) == summary2
    assert out.read_text() == text and Path(f"{out}.metrics.json").read_text() == metrics


# -- OpenAI's batch file format ------------------------------------------------------------
@pytest.fixture(scope="module")
def batch_config(tiny_dirs, tmp_path_factory):
    """tiny_dirs' config in the colocated layout (every model in one engine worker; the other
    job test runs the separate one) plus a tokenizer with a chat template (one character per
    token id)."""
    from tests.conftest import save_char_tokenizer

    _, config = tiny_dirs
    tok = tmp_path_factory.mktemp("batch-tokenizer")
    save_char_tokenizer(tok)
    path = tok / "specray.yaml"
    colocated = config.read_text().replace("placement:\n", "placement:\n  mode: colocated\n")
    assert "mode: colocated" in colocated
    path.write_text(colocated + f"tokenizer: {tok}\n")
    return path


def _batch_line(custom_id, body, url="/v1/completions"):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "tiny", **body}}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _batch_records():
    hello = [{"role": "system", "content": "abc"}, {"role": "user", "content": "hello"}]  # -> "abchelloZZ"
    return [
        _batch_line("ids", {"prompt": [5, 6, 7, 5, 6], "max_tokens": 9, "temperature": 0,
                            "speculation": {"method": "draft", "num_speculative_tokens": 2}}),
        _batch_line("text-default", {"prompt": "helloWorld", "temperature": 0}),  # no max_tokens: 16
        _batch_line("chat", {"messages": hello, "max_tokens": 10, "temperature": 0,
                             "speculation": {"method": "ngram"}}, url="/v1/chat/completions"),
        _batch_line("chat-mct", {"messages": hello, "max_completion_tokens": 5, "temperature": 0,
                                 "speculation": {"method": "medusa"}}, url="/v1/chat/completions"),
        _batch_line("chat-to-context", {"messages": [{"role": "user", "content": "hi"}], "temperature": 0},
                    url="/v1/chat/completions"),  # no max_tokens: up to the 256-token context
        _batch_line("constrained", {"prompt": "helloWorld", "max_tokens": 12, "temperature": 0,
                                    "structured_outputs": {"regex": "[a-c]{2}(x[0-9])+"}}),
        _batch_line("chat-tools", {"messages": hello, "max_tokens": 10, "temperature": 0, "tools": [TOOL],
                                   "tool_choice": "none"}, url="/v1/chat/completions"),  # rendered, never parsed
        _batch_line("sampled", {"prompt": [1, 2, 3], "max_tokens": 6, "n": 2, "seed": 5, "temperature": 1.0}),
    ]


def _check_batch_output(lines: list[dict], target) -> None:
    from tests.conftest import decode, encode

    by_id = {o["custom_id"]: o for o in lines}
    assert len(by_id) == len(lines) == 8
    for o in lines:
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert o["id"].startswith("batch_req_")
        resp = o["response"]
        assert resp["status_code"] == 200 and resp["request_id"] == resp["body"]["id"]
        assert resp["body"]["model"] == "tiny"
    expected = {  # custom_id -> (prompt ids, tokens, chat)
        "ids": ([5, 6, 7, 5, 6], 9, False),
        "text-default": (encode("helloWorld"), 16, False),
        "chat": (encode("abchelloZZ"), 10, True),
        "chat-mct": (encode("abchelloZZ"), 5, True),
        "chat-tools": (encode("abchelloZZ"), 10, True),  # the tiny template renders contents only
        "chat-to-context": (encode("hiZZ"), 256 - 4, True),
    }
    for cid, (prompt, n, chat) in expected.items():
        body = by_id[cid]["response"]["body"]
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["id"].startswith("chatcmpl-" if chat else "cmpl-")
        (choice,) = body["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        assert text == decode(hf_greedy(target, prompt, n)), cid
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n,
                                 "total_tokens": len(prompt) + n}
    assert by_id["ids"]["response"]["body"]["speculation_metrics"][0]["num_drafts"] > 0
    constrained = by_id["constrained"]["response"]["body"]["choices"][0]["text"]
    assert re.fullmatch("[a-c]{2}(x[0-9])+", constrained) or re.fullmatch("[a-c]{2}(x[0-9])*x?", constrained), constrained
    assert by_id["chat-mct"]["response"]["body"]["speculation_metrics"][0]["num_drafts"] > 0
    assert "tool_calls" not in by_id["chat-tools"]["response"]["body"]["choices"][0]["message"]
    sampled = by_id["sampled"]["response"]["body"]
    assert [c["index"] for c in sampled["choices"]] == [0, 1]
    assert sampled["usage"]["completion_tokens"] == 12 and sampled["usage"]["prompt_tokens"] == 3


def test_openai_batch_file_in_openai_output_out_and_resume(ray_session, tiny_dirs, batch_config, tmp_path, capsys,
                                                             monkeypatch):
    target = tiny_dirs[0]
    inp = _write_jsonl(tmp_path / "batch.jsonl", _batch_records())
    out = tmp_path / "out.jsonl"
    argv = ["--input", str(inp), "--output", str(out), "--config", str(batch_config), "--batch-size", "4"]
    summary, text = _run_in_process(argv, ray_session, capsys)
    lines = [json.loads(x) for x in text.splitlines()]
    assert [o["custom_id"] for o in lines] == [r["custom_id"] for r in _batch_records()]  # input order
    _check_batch_output(lines, target)
    assert summary["prompts_total"] == summary["prompts_done"] == 8 and summary["prompts_skipped"] == 0
    assert summary["generated_tokens"] == sum(o["response"]["body"]["usage"]["completion_tokens"] for o in lines)

    # A crash: the second line lost, the last one torn mid-write. Resumed by custom_id,
    # only those two are generated (appended: OpenAI matches lines by custom_id).
    kept = text.splitlines(keepends=True)
    out.write_text(kept[0] + "".join(kept[2:-1]) + kept[-1][:20])
    assert jobs.main(argv) == 0
    summary2 = _summary_from_stdout(capsys.readouterr().out)
    assert summary2["prompts_skipped"] == 6 and summary2["prompts_done"] == 2
    resumed = out.read_text().splitlines(keepends=True)
    assert resumed[:6] == [kept[0], *kept[2:-1]]  # untouched
    assert [json.loads(x)["custom_id"] for x in resumed[6:]] == ["text-default", "sampled"]
    _check_batch_output([json.loads(x) for x in resumed], target)

    # Nothing left: no coordinator, no change; the summary is the last run's, kept.
    before = out.read_text()
    with monkeypatch.context() as m:
        m.setattr("specray.actors.coordinator.Coordinator", None)  # any use of it fails
        assert jobs.main(argv) == 0
    assert _summary_from_stdout(capsys.readouterr().out) == summary2 and out.read_text() == before

    # An output of another input (an unknown custom_id) is not silently mixed in.
    out.write_text(before.replace('"custom_id": "chat"', '"custom_id": "stranger"', 1))
    assert jobs.main(argv) == 2
    assert "stranger" in capsys.readouterr().err


def test_openai_batch_bad_lines_are_rejected_up_front(batch_config, tmp_path, capsys):
    good = _batch_line("a", {"prompt": [1, 2, 3], "max_tokens": 3})
    chat = "/v1/chat/completions"
    lines = [
        good,                                                                          # 1 ok
        {k: v for k, v in good.items() if k != "custom_id"},                           # 2 no custom_id
        {**good, "custom_id": "b", "method": "GET"},                                   # 3 method
        {**good, "custom_id": "c", "url": "/v1/embeddings"},                           # 4 url
        _batch_line("d", {"prompt": [1], "max_tokens": "ten"}),                        # 5 type
        _batch_line("e", {"prompt": [1] * 200, "max_tokens": 100}),                    # 6 200 + 100 > 256
        _batch_line("f", {"prompt": [1], "stream": True}),                             # 7 stream
        _batch_line("a", {"prompt": [4]}),                                             # 8 custom_id again
        _batch_line("g", {"prompt": [1], "speculation": {"method": "medusa9"}}),       # 9 method
        _batch_line("h", {"messages": [{"role": "robot", "content": "x"}]}, url=chat),  # 10 role
        _batch_line("i", {"prompt": [1], "frobnicate": 1}),                            # 11 unknown field
        _batch_line("j", {"prompt": [1, 64]}),                                         # 12 id >= vocab
        _batch_line("k", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 300},
                    url=chat),                                                         # 13 3 + 300 > 256
        {"prompt": [1, 2]},                                                            # 14 specray line
        _batch_line("l", {"prompt": [1] * 256}),                                       # 15 prompt fills context
        _batch_line("m", {"messages": [{"role": "user", "content": "ok"}], "max_tokens": 4}, url=chat),  # 16 ok
        {**_batch_line("o", {"prompt": [1] * 200, "max_tokens": 100, "stream": True}), "method": "GET"},  # 17 all
        _batch_line("q", {"messages": [{"role": "user", "content": "ok"}], "tools": [TOOL]}, url=chat),  # 18 auto
        _batch_line("r", {"messages": [{"role": "user", "content": "ok"}], "tools": [TOOL],
                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, url=chat),  # 19 not a tool
    ]
    inp = tmp_path / "bad.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"custom_id": "n", \n'  # 20 not JSON
                   + json.dumps(_batch_line("p", {"prompt": "a\ud800b"})) + "\n")       # 21 lone surrogate
    out = tmp_path / "out.jsonl"
    assert jobs.main(["--input", str(inp), "--output", str(out), "--config", str(batch_config)]) == 2
    err = capsys.readouterr().err
    expect = {2: "custom_id", 3: "method", 4: "url", 5: "body.max_tokens", 6: "body.max_tokens",
              7: "body.stream", 8: "repeats line 1", 9: "body.speculation", 10: "body.messages.0.role",
              11: "body.frobnicate", 12: "body.prompt", 13: "body.max_completion_tokens", 14: "custom_id",
              15: "body.prompt", 18: "body.tool_choice: \"auto\" tool choice requires --enable-auto-tool-choice",
              19: "body.tool_choice: function 'g' is not among the tools", 20: "invalid JSON",
              21: "body.prompt: not valid Unicode"}
    reported: dict[int, str] = {}
    for row in err.splitlines():
        if row.strip().startswith("line "):
            n, message = row.strip()[len("line "):].split(":", 1)
            reported[int(n)] = reported.get(int(n), "") + message
    for n, word in expect.items():
        assert n in reported and word in reported[n], (n, err)
    assert 1 not in reported and 16 not in reported
    assert "300 tokens (200 in the prompt, 100 in the completion)" in reported[6]
    assert all(word in reported[17] for word in ("method", "body.stream", "body.max_tokens")), reported[17]
    assert "context length is 256" in reported[13] and "303" in reported[13]
    assert not out.exists()


def test_without_an_address_a_job_starts_a_ray_of_its_own(monkeypatch):
    """Not ray.init()'s default, which joins whatever cluster `ray start` last left on this
    machine (/tmp/ray/ray_current_cluster), perhaps someone else's or a dead one."""
    import ray

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    assert jobs._connect(None) and calls == [{"address": "local"}]
    assert jobs._connect("10.0.0.1:6379") and calls[-1] == {"address": "10.0.0.1:6379"}
