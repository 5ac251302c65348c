"""Keep-alives on streams while nothing else is sent: a long prompt prefilling (a 19K-token
coding-agent prompt takes minutes on a CPU), a queue, a grammar being compiled.

Coding agents drop a stream that stays silent for a while (Claude Code and Codex after 300 s)
and retry it. Every streaming endpoint therefore writes a keep-alive every
:data:`KEEPALIVE_INTERVAL_S` seconds (:func:`~.choices.merged_updates` says when), whether or not
it wrote other events meanwhile: a reply's tool call is held back until it is whole, and a 0.5B
model writing 3,499 tokens of one call's arguments kept a Codex stream silent until its watchdog
dropped it at 300 s. On the Responses stream
``response.in_progress`` again (an event of the API that changes nothing: Codex's watchdog counts
events, and an SSE parser skips comments before it sees them -- with comments Codex dropped an
8.8K-token prefill at 300 s); an SSE comment line (``: keep-alive``) on chat, completions and
``/generate`` streams, whose chunks have no such neutral event.

The Messages stream: ``ping`` while the request is queued (before ``message_start``, which waits
for admission to report the cache hits), then, while the prompt prefills, an empty ``text_delta``
in a text block opened for it (the block the reply's text then goes on in). Why not ``ping``
alone: the SDKs drop it (Python's ``Stream``, TypeScript's ``Stream.fromSSEResponse``), and Claude
Code's stream watchdog (300 s) is reset only by the events its SDK yields -- with pings alone it
dropped a 19K-token prefill at 300 s and resent it. Of the events an SDK yields, the empty
``text_delta`` is the one that folds into nothing: both SDKs' accumulate functions append its
text to the block's (``text += ""``), and Claude Code's own loop does the same. A ``message_delta``
with ``stop_reason: null`` and the current usage leaves the SDKs' accumulated message alone too
(stop reason, sequence and usage set to what they were), but Claude Code adds a message's usage
(and its cost) to the session's totals at every ``message_delta``: each keep-alive would count the
whole prompt once more. The one trace of the text block: a reply that turns out to be tool calls
only, after a prefill long enough for a keep-alive, has an empty text block before its
``tool_use`` blocks (read back as no text: the prompt of the next turn is the same). Times are
seconds.
"""

from __future__ import annotations

# At most this long between two writes on a stream (Anthropic's API pings about every 10-15 s;
# the agents' watchdogs wait 300 s). A module constant so tests can shorten it.
KEEPALIVE_INTERVAL_S = 10.0

SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: parsers skip it, proxies and watchdogs see bytes
ANTHROPIC_PING = 'event: ping\ndata: {"type": "ping"}\n\n'  # before message_start (the Messages stream's later ones: above)
