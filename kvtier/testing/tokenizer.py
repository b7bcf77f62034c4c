"""The tokenizer of kvtier's random-weight test models (``kvtier.testing.models``).

A byte-level BPE trained with the ``tokenizers`` library on a generated pseudo-English
corpus, deterministic for a given vocabulary size and seed, padded with extra tokens up to
the model's vocabulary so every model id decodes; with a minimal chat template so
``/v1/chat/completions`` works. Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Final

#: Special tokens, at ids 0, 1, 2.
UNK_TOKEN: Final = "<unk>"
BOS_TOKEN: Final = "<s>"
EOS_TOKEN: Final = "</s>"

#: A minimal chat template so ``/v1/chat/completions`` works.
CHAT_TEMPLATE: Final = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _words(text: str) -> list[str]:
    return text.split()


def _corpus(vocab: int, seed: int, n_lines: int) -> list[str]:
    """A deterministic pseudo-English corpus of generated words."""
    rng = random.Random(seed * 7919 + vocab)
    onsets = ["", *_words("b c d f g h k l m n p r s t v w st tr pl ch sh th br gr")]
    vowels = _words("a e i o u ai ea ou io")
    codas = ["", *_words("n r s t l m nd st ck ng")]
    # A Zipf-like lexicon: more words than merges so BPE finds enough pairs.
    n_words = max(2000, vocab * 2)
    lexicon = []
    for _ in range(n_words):
        n_syll = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        lexicon.append(
            "".join(
                rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(n_syll)
            )
        )
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    punct = [".", ",", "?", "!", ";", ":"]
    lines = []
    for _ in range(n_lines):
        words = rng.choices(lexicon, weights=weights, k=rng.randint(4, 24))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice(punct))
    # Role markers of the chat template, so they become few tokens.
    lines.extend(["<|system|>", "<|user|>", "<|assistant|>"] * 50)
    return lines


def write_tokenizer(out: Path, *, vocab: int, seed: int, max_pos: int) -> None:
    """Train the byte-level BPE tokenizer of a ``vocab``-token model (the corpus drawn from
    ``seed``) and write its files into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(vocab, seed, n_lines=max(3000, vocab)), trainer=trainer)
    # Every model id must decode: pad the vocabulary up to the model's size.
    missing = vocab - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab:
        raise RuntimeError(f"tokenizer has {size} tokens, model has {vocab}")
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_pos,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": EOS_TOKEN,
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=1))
