"""The code environment as a Ray actor: rewards from test cases, hostile programs contained with the actor
still serving, and the multi-turn mode."""

import os

import pytest
import ray

from nemo_grpo.config import CodeEnvConfig
from nemo_grpo.envs import create_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADD = {"tests": [{"input": "1 2\n", "output": "3"}, {"input": "5 5\n", "output": "10"},
                 {"input": "0 7\n", "output": "7"}]}
RIGHT = "a, b = map(int, input().split())\nprint(a + b)"


def reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "add two numbers"}, {"role": "assistant", "content": text}]


@pytest.fixture(scope="module")
def env(ray_cluster):
    secret = {"env_vars": {"NEMO_GRPO_TEST_SECRET": "s3cr3t"}}  # in the trainer-side actor's environment
    actor = create_env("code", CodeEnvConfig(num_workers=2, timeout_s=2.0, cpu_s=2, memory_mb=256), runtime_env=secret)
    yield actor
    ray.get(actor.shutdown.remote())


def step(env, texts, infos):
    ret = ray.get(env.step.remote([reply(t) for t in texts], infos))
    _, metrics = ray.get(env.global_post_process_and_metrics.remote({"rewards": ret.rewards}))
    return ret, metrics


def test_right_wrong_and_partial_solutions(env):
    texts = [f"```python\n{RIGHT}\n```", "print(3)", "a, b = map(int, input().split())\nprint(a * b if a else b)",
             "def f(:", "def add(a, b):\n    return a + b", "x = 6 * 7\nprint('thinking')\nprint(x)"]
    infos = [ADD, ADD, ADD, ADD, {"tests": [{"assert": "assert add(2, 2) == 4"}, {"assert": "assert add(1, 0) == 2"}]},
             {"ground_truth": "42"}]
    ret, metrics = step(env, texts, infos)
    assert ret.rewards.tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 0.0, 0.5, 1.0])  # print(3): case 1 only
    assert ret.terminateds.all()
    assert metrics["code/syntax_errors"] == 1 and metrics["code/accuracy"] == pytest.approx(2 / 6)
    assert metrics["code/errors"] == 1  # the failing assert


def test_all_or_nothing(ray_cluster):
    actor = create_env("code", CodeEnvConfig(num_workers=1, reward_mode="all_or_nothing", timeout_s=2.0))
    try:
        ret = ray.get(actor.step.remote([reply(RIGHT), reply("print(3)")], [ADD, ADD]))
        assert ret.rewards.tolist() == [1.0, 0.0]
    finally:
        ray.get(actor.shutdown.remote())


HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory bomb": "x = []\nwhile True:\n    x.append(bytearray(50 * 1024 * 1024))",
    "huge output": "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1024 * 1024))",
    "write outside": f"open({os.path.join(ROOT, 'pwned_by_model')!r}, 'w').write('x')\nprint(3)",
    "read environment": "import os\nprint(os.environ.get('NEMO_GRPO_TEST_SECRET', 3))",
    "orphan child": "import subprocess, time\nsubprocess.Popen(['sleep', '60'], start_new_session=True)\ntime.sleep(60)",
    "kill parent": "import os, signal\nos.kill(os.getppid() or 1, signal.SIGKILL)\nprint(3)",
    "delete project": f"import shutil\nshutil.rmtree({os.path.join(ROOT, 'tests')!r})\nprint(3)",
}


def test_hostile_programs_score_zero_and_the_actor_keeps_serving(env):
    """Each hostile program gets reward 0 (or the partial reward its 'print(3)' earns on case 1 when its
    attack fails without crashing); nothing outside changes; the next batch is scored normally."""
    ret, metrics = step(env, list(HOSTILE.values()), [ADD] * len(HOSTILE))
    rewards = dict(zip(HOSTILE, ret.rewards.tolist()))
    for name in ("infinite loop", "fork bomb", "memory bomb", "huge output", "orphan child"):
        assert rewards[name] == 0.0, (name, rewards)
    for name in ("write outside", "delete project"):  # the attack raises before print(3): 0
        assert rewards[name] == 0.0, (name, rewards)
    assert rewards["read environment"] == pytest.approx(1 / 3)  # the secret is not there: prints 3
    assert rewards["kill parent"] in (0.0, pytest.approx(1 / 3))  # the kill is refused or hits its own init
    assert not os.path.exists(os.path.join(ROOT, "pwned_by_model")) and os.path.isdir(os.path.join(ROOT, "tests"))
    assert metrics["code/timeouts"] >= 2
    ret, _ = step(env, [RIGHT], [ADD])
    assert ret.rewards.tolist() == [1.0]


def test_multi_turn_runs_code_then_scores_the_last_program(ray_cluster):
    actor = create_env("code", CodeEnvConfig(num_workers=1, terminate_on_evaluation=False, timeout_s=2.0))
    try:
        first = ray.get(actor.step.remote([reply("let me try\n```python\nprint(40 + 2)\n```")], [ADD]))
        assert not first.terminateds[0] and first.observations[0]["content"] == "output:\n42\n"
        assert first.metadata[0]["last_code"] == "print(40 + 2)\n" and first.rewards[0] == 0
        second = ray.get(actor.step.remote([reply(f"```python\n{RIGHT}\n```")], first.metadata))
        assert not second.terminateds[0]
        final = ray.get(actor.step.remote([reply("done: it adds the two numbers")], second.metadata))
        assert final.terminateds[0] and final.rewards.tolist() == [1.0]
    finally:
        ray.get(actor.shutdown.remote())


@pytest.mark.parametrize("once", [True, False])
def test_identical_programs_of_a_step_share_one_execution(ray_cluster, once):
    """run_identical_once (the default): the copies of a program in one step get one execution, so one clock
    reading; false: every copy runs and reads the clock itself."""
    cfg = CodeEnvConfig(num_workers=2, terminate_on_evaluation=False, timeout_s=2.0, run_identical_once=once)
    actor = create_env("code", cfg)
    try:
        clock = reply("```python\nimport time\nprint(time.time_ns())\n```")
        ret = ray.get(actor.step.remote([clock] * 4 + [reply("```python\nprint(1)\n```")], [ADD] * 5))
        outputs = [o["content"] for o in ret.observations]
        assert len(set(outputs[:4])) == (1 if once else 4) and outputs[4] == "output:\n1\n", outputs
    finally:
        ray.get(actor.shutdown.remote())


def test_copies_of_a_program_are_scored_and_counted_each(env):
    ret, metrics = step(env, ["def f(:"] * 3 + [RIGHT, "print(3)", RIGHT], [ADD] * 6)
    assert ret.rewards.tolist() == pytest.approx([0.0, 0.0, 0.0, 1.0, 1 / 3, 1.0])
    assert metrics["code/syntax_errors"] == 3 and metrics["code/num_samples"] == 6
