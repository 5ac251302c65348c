"""Texts that exercise a tokenizer where implementations part ways: unicode (accents, CJK, emoji with
joiners, flags, astral letters), digits and numbers, runs of spaces / tabs / newlines, code, URLs and
chat markup (special tokens inside text). Used by the tokenizer tests and bench_model_agreement.py."""

TOKENIZER_CORPUS = (
    "Hello world", "  leading spaces and trailing  ", "a   b    c\t\td", "naïve café — “quotes” ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 😀🚀",
    "日本語のテキストと中文混合 text 한국어", "Numbers: 3.14159, 1,234,567 and 2026-12-04T22:29:36Z; 0x1F 1e-6",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n", "line one\n\n\n\nline five\r\nwindows",
    "   \n   \n", "URL: https://example.com/a?b=c&d=e#frag", "emoji family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    " " * 40 + "forty spaces, then" + "\n" * 35 + "thirty-five newlines",
)
