"""Writes the engine simulator's tokenizer: a small byte-level BPE (GPT-2's scheme), trained
here on a fixed synthetic corpus, saved as a Hugging Face tokenizer directory that
`AutoTokenizer.from_pretrained(DIR)` loads with no network: what LMCache's `lmcache bench
engine --model DIR` and the simulator both tokenize with, so prompts have the same token
counts on both sides.

It is a stand-in for a model's tokenizer, not one: deterministic (the same corpus and
settings give the same vocabulary), GPT-2's size (50,257 entries: prefix-suffix-tuner draws
random token ids up to 50,000), words spelled with GPT-2's `Ġ` word-start marker, and at
least 9,000 lowercase words that are one token each (long-doc-permutator's single-token word
pool takes 8,000; the script checks).

Usage: python make_tokenizer.py OUT_DIR
"""
import json
import os
import random
import string
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 50257
PSEUDO_WORDS = 30000
MIN_ONE_TOKEN_WORDS = 9000


def corpus():
    """Words the benches write (their questions, "hi", numbers) and a pool of pseudo-words."""
    rng = random.Random(20261205)
    common = ("the a an of to in is it and or what which who how this that these document "
              "documents question questions answer summarize summary key points main topic "
              "discussed provide brief overview user assistant system context hi hello you "
              "are helpful please read following tell me about").split()
    pseudo = set()
    while len(pseudo) < PSEUDO_WORDS:
        n = rng.randint(3, 7)
        pseudo.add("".join(rng.choice(string.ascii_lowercase) for _ in range(n)))
    words = common + sorted(pseudo)
    lines = []
    for _ in range(4000):
        k = rng.randint(5, 30)
        line = " ".join(rng.choice(words) for _ in range(k))
        lines.append(f"{line} {rng.randint(0, 9999)}: {line.capitalize()}?\n")
    # Every word many times over, so each becomes one token.
    # The benches' own words first and most: each must become a single token.
    lines += [" ".join(common)] * 400
    lines += [" ".join(words)] * 50
    return lines


def one_token_words(tok):
    """Lowercase vocabulary words that encode to one token after a space."""
    words = sorted({k[1:] for k in tok.get_vocab() if k.startswith("Ġ") and k[1:].isascii()
                    and k[1:].isalpha() and k[1:].islower()})
    encoded = tok.encode_batch([" " + w for w in words], add_special_tokens=False)
    return [w for w, e in zip(words, encoded) if len(e.ids) == 1]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    n = len(one_token_words(tok))
    if n < MIN_ONE_TOKEN_WORDS or tok.get_vocab_size() < 50000:
        sys.exit(f"make_tokenizer: {n} one-token words and {tok.get_vocab_size()} entries; "
                 f"need {MIN_ONE_TOKEN_WORDS} and 50,000")
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>",
            "model_max_length": 1 << 20,
            "clean_up_tokenization_spaces": False,
            # role: content per message, one per line: what the simulator feeds its "model".
            "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
        }, f, indent=1)
    print(out)


if __name__ == "__main__":
    main()
