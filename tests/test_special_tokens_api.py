"""BOS through the API, on an HF tokenizer set up as Llama 3's is: its tokenizer.json post-processor puts
<|begin_of_text|> before every encoded text, and its chat template writes {{ bos_token }} too. Completions
must start with BOS (vLLM's default `add_special_tokens: true`); chat prompts must hold exactly one (the
template's: vLLM's chat default is `add_special_tokens: false`). The prompt ids are read from the engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import processors

from engine.baselines.seed import FixedPolicy
from engine.core.llm_engine import LLMEngine
from engine.model.loaders.hf import read_tokenizer
from engine.model.tokenizer import Tokenizer
from engine.serving.app import create_app
from engine.serving.async_engine import AsyncEngine
from engine.serving.context import AppContext
from tests.fake_backend import FakeBackend
from tests.fixtures_llama import CHAT_TEMPLATE, SPECIAL_TOKENS, train_tokenizer
from tests.inproc_server import serve_in_thread
from tests.test_server_errors import assert_error

BOS = "<|begin_of_text|>"


def llama_style_tokenizer(path: Path) -> Tokenizer:
    """The fixture's BPE with a Llama 3 BOS added as HF saves it: tokenizer.json and tokenizer_config.json."""
    tok = train_tokenizer()
    tok.add_special_tokens([BOS])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
    )
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": SPECIAL_TOKENS[2], "chat_template": "{{ bos_token }}" + CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return read_tokenizer(path)


class Served:
    def __init__(self, url: str, backend: FakeBackend, tokenizer: Tokenizer) -> None:
        self.url, self.backend, self.tokenizer = url, backend, tokenizer

    def prompt_of_last_request(self) -> list[int]:
        return list(self.backend.steps[-1].items[0].prompt_ids)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tokenizer = llama_style_tokenizer(tmp_path_factory.mktemp("tok") / "llama3-style")
    backend = FakeBackend(num_blocks=64, block_size=4, max_model_len=256)
    engine = AsyncEngine(LLMEngine(backend, FixedPolicy()), max_waiting=8)
    app = create_app(
        AppContext(
            engine,
            model_name="tiny",
            tokenizer=tokenizer,
            vocab_size=tokenizer.vocab_size,
            trust_request_chat_template=True,  # the tests below bring their own templates
        )  # fmt: skip
    )
    with serve_in_thread(app) as url:
        yield Served(url, backend, tokenizer)


def post(served: Served, path: str, body: dict) -> httpx.Response:
    return httpx.post(served.url + path, json={"max_tokens": 1, **body}, timeout=60)


def test_completions_start_with_bos_unless_told_not_to(served: Served) -> None:
    bos = served.tokenizer.bos_token_id
    plain = served.tokenizer.encode("Hello world")
    assert bos is not None and bos not in plain
    assert post(served, "/v1/completions", {"prompt": "Hello world"}).status_code == 200
    assert served.prompt_of_last_request() == [bos, *plain]
    r = post(served, "/v1/completions", {"prompt": "Hello world", "add_special_tokens": False})
    assert r.status_code == 200 and served.prompt_of_last_request() == plain


def test_chat_prompts_hold_the_template_s_bos_only(served: Served) -> None:
    bos = served.tokenizer.bos_token_id
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    assert post(served, "/v1/chat/completions", {"messages": messages}).status_code == 200
    ids = served.prompt_of_last_request()
    assert ids[0] == bos and ids.count(bos) == 1
    system = served.tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>")
    assert ids[1 : 1 + len(system)] == system  # developer is rendered as system


# A template that reads `tools` gets tool messages as they came (one that does not, the fixture's, gets them as
# engine/model/tool_template.py's fallback renders them, and never sees the role).
REJECTS_TOOL = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('unknown role tool') }}{% endif %}"
    "{% endfor %}{{ tools }}"
)


def test_a_template_that_rejects_tool_messages_is_a_400_naming_messages(served: Served) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    body = {"messages": messages, "chat_template": REJECTS_TOOL}
    err = assert_error(post(served, "/v1/chat/completions", body), 400, "messages")
    assert "unknown role tool" in err["message"]
