"""Requests made ready to submit (on the worker pool: :meth:`ServerState.off_loop`): an OpenAI-shaped
body's sampling parameters (chat and text completions), and a chat request's prompt -- the template
rendered with its tools, tokenized, fitted to the context. What the OpenAI chat route (:mod:`.app`),
the Messages API (:mod:`.anthropic`) and the Responses API (:mod:`.responses`) share; they import it,
it imports none of them. Counts are tokens.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ..errors import InvalidRequestError
from ..runtime.sampling import GrammarSpec, SamplingParams
from .builtin_tools import note_dropped, split_chat_tools
from .choices import check_choices
from .hints import check_key, openai_hints
from .protocol import APIError, ChatCompletionRequest, SamplingBody, sampling_fields
from .state import ServerState
from .submit import Prepared, check_fits, with_reply_room
from .system_turns import place_system_messages
from .tools import ChatPrompt, chat_prompt

logger = logging.getLogger(__name__)

_UNKNOWN_LOGGED: set[str] = set()  # request fields already logged as ignored (once each)


def sampling_params(st: ServerState, body: SamplingBody, max_new: Optional[int], default_max: int,
                    grammar: Optional[GrammarSpec] = None, lazy: Optional[GrammarSpec] = None) -> SamplingParams:
    """The request's sampling parameters; ``grammar`` (a forced tool call) or the body's own
    structured-output fields, checked by the engine's grammar compiler (400 if unusable); else
    ``lazy`` (the grammar of calls the model begins), dropped where the engine cannot take it."""
    body = body.with_unset(st.sampling_defaults)
    bad = body.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    for name in sorted(body.model_extra.keys() - _UNKNOWN_LOGGED):  # the fields this server does not know
        _UNKNOWN_LOGGED.add(name)
        logger.info("ignoring the request field %r (not an OpenAI, SGLang or vLLM field this server uses)", name)
    if max_new is not None and max_new < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_new}.", param="max_tokens")
    param, own = body.grammar_spec() or (None, None)
    if grammar is not None and own is not None:
        raise APIError(400, "a forced tool call cannot be combined with response_format, regex or ebnf.",
                       param="tool_choice")
    sp = SamplingParams(max_new_tokens=max_new if max_new is not None else default_max,
                        grammar=grammar or own or usable_lazy(st, lazy), **sampling_fields(body, "logit_bias"),
                        logprobs=body.top_logprobs_k())
    try:
        st.engine.check_sampling(sp)  # (the grammar is vetted next, without holding this thread: vet_grammar)
    except InvalidRequestError as e:
        field = "tools" if grammar is not None and e.param == "grammar" else body.field_of(e.param)
        raise APIError(400, str(e), param=field or param) from None
    return sp


def usable_lazy(st: ServerState, spec: Optional[GrammarSpec]) -> Optional[GrammarSpec]:
    """``spec`` unless the engine cannot take it (grammars off, too long): a request is never refused
    for the grammar of calls it did not force; it then runs without it (logged)."""
    if spec is None or st.engine.config.grammar_backend == "none":
        return None
    try:
        spec.validate()
    except InvalidRequestError as e:
        logger.warning("tool calls under tool_choice auto run without their grammar: %s", e)
        return None
    return spec


def render_chat(body: ChatCompletionRequest, st: ServerState) -> tuple[ChatPrompt, tuple[str, ...], str]:
    """``body``'s prompt as the template renders it, with its tools written in: the chat prompt (calls'
    names and grammars), the tools dropped (server/builtin_tools.py) and the prompt's text."""
    tok = st.engine.tokenizer
    tools, dropped = split_chat_tools(body.tools or [])
    chat = chat_prompt(body.messages, tools or None, body.tool_choice, body.parallel_tool_calls, tok.renders_tools,
                       st.call_format, tok.special_token_id, lazy=st.opts.tool_call_grammar == "lazy")
    try:
        text = tok.apply_chat_template(place_system_messages(chat.messages, tok), add_generation_prompt=True,
                                       tools=chat.template_tools)
    except InvalidRequestError as e:  # no template, or it raised or ran past a limit (model/chat_render.py)
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # the model's Jinja template refused these messages
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
    return chat, dropped, text


def prepare_chat(body: ChatCompletionRequest, st: ServerState,
                 encode: Optional[Callable[[str], list[int]]] = None) -> Prepared:
    """A chat request made ready to submit: the template rendered with its tools, tokenized (by
    ``encode``, the tokenizer's by default), sampling checked, its cache hints read (server/hints.py).
    The Messages and Responses APIs' requests are prepared here too, as the chat requests they mean
    (server/anthropic.py, server/responses_request.py)."""
    st.check_model(body.model)
    hints = openai_hints(body.prompt_cache_retention)
    check_key(body.prompt_cache_key)
    chat, dropped, text = render_chat(body, st)
    forced = GrammarSpec("lark", chat.forced_grammar) if chat.forced_grammar else None
    lazy = GrammarSpec("lark", chat.lazy_grammar[0], triggers=chat.lazy_grammar[1]) if chat.lazy_grammar else None
    # (without a max, the rest of the context once the prompt is tokenized: with_reply_room below)
    sp = sampling_params(st, body, body.max_new_tokens(), st.engine.context_length, forced, lazy)
    check_choices(body.n, 1, sp, body.stream, st.opts.max_logprob_tokens)
    ids = (encode or st.engine.tokenizer.encode)(text)
    check_fits(ids, body.max_new_tokens(), st.engine.context_length, "messages")
    if body.max_new_tokens() is None:
        sp = with_reply_room(st, sp, len(ids), st.opts.default_max_tokens)
    return Prepared(body, [ids], sp, "messages", chat.call_names, body.n,
                    "tools" if forced is not None else body.field_of("grammar"), st.call_format, note_dropped(dropped),
                    hints)
