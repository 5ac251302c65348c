"""Chat templates (issue 47): a model file without one refuses chats in one sentence (no silent
ChatML), ``--chat-template`` takes a file or a built-in name, templates render as transformers
renders them (``raise_exception``, ``strftime_now``)."""

from __future__ import annotations

import datetime

import httpx
import pytest
from gguf_edit import rewrite_gguf

from hicache import Engine, SamplingParams
from hicache.config import ConfigError
from hicache.errors import InvalidRequestError
from hicache.model.chat_templates import BUILTIN
from hicache.server.serve import ServerThread

pytestmark = pytest.mark.engine

HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """The tiny GGUF file without its chat template (a base model)."""
    return str(rewrite_gguf(tmp_path_factory.mktemp("base") / "base.gguf", kv={"tokenizer.chat_template": None}))


def test_a_model_without_a_template_refuses_chats_and_serves_completions(base_model):
    engine = Engine(base_model, dtype="float32", max_total_tokens=2048)
    try:
        with pytest.raises(InvalidRequestError, match="no chat template .* --chat-template FILE or one of chatml"):
            engine.chat(HI, SamplingParams(max_new_tokens=2))
        srv = ServerThread(engine, served_model_name="m")
        url = srv.start()
        try:
            r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200
        finally:
            srv.stop()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name, says", [
    ("gemma", "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"),
    ("llama3", "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"),
    ("chatml", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
])
def test_built_in_templates(base_model, name, says):
    engine = Engine(base_model, dtype="float32", max_total_tokens=2048, chat_template=name)
    try:
        assert says in engine.tokenizer.apply_chat_template(HI)
        assert engine.chat(HI, SamplingParams(max_new_tokens=2, temperature=0)).completion_tokens >= 1
    finally:
        engine.shutdown()


def test_a_template_file_with_strftime_now(base_model, tmp_path):
    (tmp_path / "t.jinja").write_text("{{ strftime_now('%Y') }}|{% for m in messages %}{{ m['content'] }};{% endfor %}"
                                      "{% if messages | length > 5 %}{{ raise_exception('too long') }}{% endif %}")
    engine = Engine(base_model, dtype="float32", max_total_tokens=2048, chat_template=str(tmp_path / "t.jinja"))
    try:
        assert engine.tokenizer.apply_chat_template(HI) == f"{datetime.datetime.now().year}|Be brief.;Hi;"
        with pytest.raises(Exception, match="too long"):
            engine.tokenizer.apply_chat_template(HI * 3)
    finally:
        engine.shutdown()


def test_an_unknown_template_is_one_sentence(base_model):
    with pytest.raises(ConfigError, match=f"neither a file nor a built-in template \\({', '.join(BUILTIN)}\\)"):
        Engine(base_model, dtype="float32", max_total_tokens=2048, chat_template="nope")
