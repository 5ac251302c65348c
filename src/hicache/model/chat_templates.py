"""Built-in chat templates, for ``--chat-template NAME``: a model file without a template of its
own (a base model, e.g. Gemma 3 270M) or one whose template a user wants to replace. Each writes
the family's own turn markup; a template file works the same way (``--chat-template FILE``)."""

from __future__ import annotations

from pathlib import Path

from hicache.errors import ConfigError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma has no system turn: a system message opens the first user turn.
GEMMA = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\n' + ns.system"
    " + (message['content'] | trim) + '<end_of_turn>\n' }}{% set ns.system = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
BUILTIN = {"chatml": CHATML, "gemma": GEMMA, "llama3": LLAMA3}


def resolve_chat_template(name_or_file: str) -> str:
    """The template text of a built-in name or a Jinja file; ConfigError otherwise."""
    if name_or_file in BUILTIN:
        return BUILTIN[name_or_file]
    path = Path(name_or_file).expanduser()
    if not path.is_file():
        raise ConfigError(f"--chat-template {name_or_file!r} is neither a file nor a built-in template "
                          f"({', '.join(BUILTIN)}).")
    return path.read_text(encoding="utf-8")
