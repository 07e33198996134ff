"""The judges behind env.llm_judge, one protocol (judging.Judge): `judge(conversations, seed) -> replies`, seed None
for greedy decoding, else request i samples with a seed derived from (seed, i); a reply is None where the request
failed.

- `EngineJudge`: in the cluster, our own generation engine (generation/: torch or vLLM, env.llm_judge.generation)
  on the judge's model, frozen: nothing ever refits it. Each conversation is rendered with the judge tokenizer's
  chat template; a prompt longer than the judge's context less max_new_tokens keeps its last tokens (counted).
- `HttpJudge`: any OpenAI-compatible /v1/chat/completions (vLLM's `vllm serve`, a hosted API), with the openai
  package: at most judge_endpoint_max_concurrency requests in flight, timeout_s each, max_retries retries with
  the client's exponential backoff; a request that still fails is None (the environment asks again, then gives
  default_score). `check_endpoint` is the start-up check: a server that cannot be reached is a ConfigError
  naming env.llm_judge.base_url.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from nemo_grpo.config import ClusterConfig, LlmJudgeConfig
from nemo_grpo.data.prompts import render_prompt
from nemo_grpo.errors import ConfigError
from nemo_grpo.generation import make_generation_engine
from nemo_grpo.generation.interface import request_seed
from nemo_grpo.models.builtin import resolve_model_path
from nemo_grpo.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
NO_KEY = "EMPTY"  # the API key sent when env.llm_judge.api_key_env is null (vLLM's server asks for none)
CHECK_TIMEOUT_S = 10.0  # the start-up check's own timeout


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class EngineJudge:
    """The in-cluster judge: a generation engine on env.llm_judge.model_name (its `replicas`: one Ray scheduling
    strategy each, resource_plan.judge_replicas; (None,): one replica, anywhere)."""

    def __init__(self, cfg: LlmJudgeConfig, replicas=(None,), num_threads: int = 1):
        model_path = resolve_model_path(cfg.model_name)  # builtin:smollm2-135m-instruct: its cached build
        self.tokenizer = load_tokenizer(cfg.tokenizer.name or model_path)
        if cfg.tokenizer.chat_template is not None:
            self.tokenizer.chat_template = cfg.tokenizer.chat_template
        self.max_new_tokens = cfg.generation.max_new_tokens
        context = _context_length(cfg, model_path)
        self.max_prompt_tokens = context - self.max_new_tokens
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"config key 'env.llm_judge.generation.max_new_tokens': {self.max_new_tokens} leaves "
                              f"no room for a prompt in the judge's context of {context} tokens")
        self.truncated = 0  # prompts cut to their last max_prompt_tokens tokens, since the last take_truncated()
        self.engine = make_generation_engine(cfg.generation.engine_config(), model_path,
                                             ClusterConfig(num_threads_per_worker=num_threads), replicas=replicas)

    def __call__(self, conversations: list[list[dict]], seed: Optional[int]) -> list[Optional[str]]:
        prompts = []
        for conversation in conversations:
            ids = render_prompt(self.tokenizer, conversation)
            if len(ids) > self.max_prompt_tokens:
                self.truncated += 1
                ids = ids[-self.max_prompt_tokens:]
            prompts.append(ids)
        outputs = self.engine.generate(prompts, greedy=seed is None, seed=seed)
        return [self.tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outputs]

    def take_truncated(self) -> int:
        """Prompts truncated since the last call."""
        n, self.truncated = self.truncated, 0
        return n

    def shutdown(self) -> None:
        self.engine.shutdown()


def _context_length(cfg: LlmJudgeConfig, model_path: str) -> int:
    """The judge's context in tokens: generation.vllm_cfg.max_model_len, else what the vLLM engine takes without it
    (vllm_engine.default_max_model_len: its config's max_position_embeddings, capped)."""
    if cfg.generation.vllm_cfg.max_model_len is not None:
        return cfg.generation.vllm_cfg.max_model_len
    from transformers import AutoConfig  # here: ~1 s to import

    from nemo_grpo.generation.vllm_engine import default_max_model_len

    return default_max_model_len(AutoConfig.from_pretrained(model_path))


def _client(cfg: LlmJudgeConfig, timeout_s: float, max_retries: int, api_key: Optional[str] = None):
    """An openai client of base_url; api_key: the key (None: read from the variable api_key_env names)."""
    try:
        from openai import OpenAI
    except ImportError:
        raise ConfigError("config key 'env.llm_judge.base_url': the HTTP judge needs the openai package (pip install "
                          "'nemo-grpo[judge]')") from None
    key = api_key if api_key is not None else os.environ.get(cfg.api_key_env, "") if cfg.api_key_env else NO_KEY
    return OpenAI(base_url=cfg.base_url, api_key=key, timeout=timeout_s, max_retries=max_retries)


def check_endpoint(cfg: LlmJudgeConfig) -> None:
    """The start-up check of an HTTP judge: its server answers /models and serves env.llm_judge.model; else a
    ConfigError of one line naming base_url (or model, with the served ones)."""
    client = _client(cfg, min(cfg.timeout_s, CHECK_TIMEOUT_S), 0)  # (a ConfigError without the openai package)
    import openai

    try:
        served = [m.id for m in client.models.list()]
    except openai.OpenAIError as e:
        raise ConfigError(f"config key 'env.llm_judge.base_url': cannot reach the judge at {cfg.base_url}: "
                          f"{_one_line(e)}") from None
    finally:
        client.close()
    if cfg.model not in served:
        raise ConfigError(f"config key 'env.llm_judge.model': {cfg.base_url} does not serve '{cfg.model}'; it serves "
                          f"{', '.join(served) or 'no model'}")


class HttpJudge:
    """The judge behind an OpenAI-compatible URL (env.llm_judge.base_url, model; api_key: the key the driver read
    from api_key_env, None: read it here)."""

    def __init__(self, cfg: LlmJudgeConfig, api_key: Optional[str] = None):
        self.cfg = cfg
        self.client = _client(cfg, cfg.timeout_s, cfg.max_retries, api_key)
        self.pool = ThreadPoolExecutor(cfg.judge_endpoint_max_concurrency, thread_name_prefix="llm-judge")

    def __call__(self, conversations: list[list[dict]], seed: Optional[int]) -> list[Optional[str]]:
        return list(self.pool.map(lambda item: self._ask(item[1], seed, item[0]), enumerate(conversations)))

    def _ask(self, conversation: list[dict], seed: Optional[int], index: int) -> Optional[str]:
        import openai

        g = self.cfg.generation
        sampled = {} if seed is None else {"seed": request_seed(seed, index) % 2**31}
        if g.stop_strings:
            sampled["stop"] = list(g.stop_strings)
        try:
            reply = self.client.chat.completions.create(
                model=self.cfg.model, messages=conversation, max_tokens=g.max_new_tokens,
                temperature=0.0 if seed is None else g.temperature, top_p=1.0 if seed is None else g.top_p, **sampled)
        except openai.OpenAIError as e:
            log.warning("LLM judge request to %s failed after %d retries: %s", self.cfg.base_url,
                        self.cfg.max_retries, _one_line(e))
            return None
        return reply.choices[0].message.content or ""

    def take_truncated(self) -> int:
        """0: the server cuts no prompt (one longer than its context is a failed request)."""
        return 0

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
