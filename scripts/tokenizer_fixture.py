#!/usr/bin/env python3
"""A byte-level BPE tokenizer.json of the kind Qwen ships (ByteLevel pre-tokenizer and
decoder, BPE model), trained small with Hugging Face `tokenizers`, plus the ids that
library gives for a few prompts and option labels, so `loraq run`'s tokenization of
`prompt` records is checked against the reference implementation.

Pinned: tokenizers==0.23.3 (scripts/requirements-model.txt's environment).
Run from the repository root: python scripts/tokenizer_fixture.py
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = "tests/data/tokenizer"
CORPUS = [
    "Is a service down? The checkout page returns errors for every request.",
    "Question: which option is correct? Answer with A, B, C or D.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Quantized bases change answers near ties; 你好, naïve café, emoji 🙂.",
] * 20

tokenizer = Tokenizer(models.BPE(unk_token=None))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=400,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    special_tokens=["<|endoftext|>"],
)
tokenizer.train_from_iterator(CORPUS, trainer)
os.makedirs(OUT, exist_ok=True)
tokenizer.save(os.path.join(OUT, "tokenizer.json"))

prompts = [
    "Is a service down?",
    "Question: which option is correct? Answer:",
    "naïve café 你好 🙂 unseen-words xyz",
    " A",
]
expected = {p: tokenizer.encode(p, add_special_tokens=False).ids for p in prompts}
with open(os.path.join(OUT, "expected.json"), "w") as f:
    json.dump({"vocab_size": tokenizer.get_vocab_size(), "encodings": expected}, f, indent=1, ensure_ascii=False)
    f.write("\n")
print(json.dumps(expected, ensure_ascii=False))
