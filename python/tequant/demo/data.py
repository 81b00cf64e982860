"""The demo's dataset: a character-level corpus generated deterministically from a seed.

Lines of a small procedural grammar, each kind with structure a small GPT can pick up in a few
hundred steps: sentences (subject-verb agreement, fixed word spellings), arithmetic with correct
results, balanced nested brackets, copies of random strings (attention must look back) and
counting runs. No downloads; the same seed gives the same bytes on every machine.
Tests: tests/test_demo.py (through the demo).
"""
import random

import torch

# A fixed alphabet, so token ids never depend on the corpus that was drawn.
VOCAB = "\n !()*+,-.:<=>?[]{}|0123456789abcdefghijklmnopqrstuvwxyz"

_ADJ = ["small", "large", "quick", "lazy", "green", "old", "young", "quiet", "bright", "heavy"]
_NOUN = ["cat", "dog", "bird", "fox", "horse", "robot", "child", "farmer", "train", "river"]
_PLURAL = {"child": "children", "fox": "foxes"}
_VERB = ["see", "chase", "follow", "help", "watch", "find", "carry", "push"]
_PLACE = ["in the park", "near the house", "by the river", "at night", "on the hill"]
_BRACKETS = ["()", "[]", "{}", "<>"]
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _noun_phrase(rng):
    noun = rng.choice(_NOUN)
    plural = rng.random() < 0.4
    if plural:
        noun = _PLURAL.get(noun, noun + "s")
    words = [rng.choice(["the", "a"]) if not plural else rng.choice(["the", "some", "two"])]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJ))
    words.append(noun)
    if words[0] == "a" and words[1][0] in "aeiou":  # one more rule to learn
        words[0] = "an"
    return " ".join(words), plural


def _sentence(rng):
    subject, plural = _noun_phrase(rng)
    verb = rng.choice(_VERB)
    if not plural:  # agreement: the model must remember the subject's number
        verb = verb + "es" if verb.endswith(("sh", "ch", "ss")) else verb + "s"
    obj, _ = _noun_phrase(rng)
    tail = " " + rng.choice(_PLACE) if rng.random() < 0.5 else ""
    return f"{subject} {verb} {obj}{tail}."


def _arithmetic(rng):
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"{a}*{b}={a * b}"
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}={a + b}" if op == "+" else f"{max(a, b)}-{min(a, b)}={abs(a - b)}"


def _brackets(rng, depth=0):
    # Each closing bracket is determined by the stack of open ones: learnable exactly.
    parts = []
    for _ in range(rng.randint(1, 3 if depth < 3 else 1)):
        open_, close = rng.choice(_BRACKETS)
        inner = _brackets(rng, depth + 1) if depth < 4 and rng.random() < 0.6 else ""
        parts.append(open_ + inner + close)
    return "".join(parts)


def _copy(rng):
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(3, 8)))
    return f"copy {word}|{word}"


def _count(rng):
    start = rng.randint(0, 90)
    if rng.random() < 0.5:
        return "count " + " ".join(str(v) for v in range(start, start + rng.randint(3, 8)))
    i = rng.randint(0, 20)
    return "abc " + _LETTERS[i:i + rng.randint(3, 6)]


_KINDS = [(_sentence, 4), (_arithmetic, 2), (_brackets, 1), (_copy, 2), (_count, 1)]


def generate_text(num_chars, seed):
    """At least num_chars characters of the grammar, one item per line, from `seed`."""
    rng = random.Random(seed)
    makers = [m for m, w in _KINDS for _ in range(w)]
    lines, total = [], 0
    while total < num_chars:
        line = rng.choice(makers)(rng)
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines) + "\n"


_TABLE = bytes.maketrans(VOCAB.encode(), bytes(range(len(VOCAB))))


def encode(text):
    """Token ids (uint8: the corpus takes 1 byte a character on the device) of text, which must
    use only VOCAB's characters."""
    raw = bytearray(text.encode("ascii").translate(_TABLE))
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def decode(ids):
    return "".join(VOCAB[int(i)] for i in ids)


def unigram_entropy(ids):
    """Entropy (nats per character) of the character frequencies: the loss of a model that has
    learned the frequencies and nothing else; a model below it has learned structure."""
    counts = torch.bincount(ids.long(), minlength=len(VOCAB)).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class Corpus:
    """Train and validation token streams (different seeds, so validation text is unseen) and
    the batches drawn from them.

    train_batches(...) yields the same windows in the same order for a given seed, so every run
    of the demo sees identical data; val_batches() is a fixed set of windows.
    """

    def __init__(self, train_chars, val_chars, seed, device):
        self.train = encode(generate_text(train_chars, seed)).to(device)
        self.val = encode(generate_text(val_chars, seed + 1_000_003)).to(device)
        self.unigram_entropy = unigram_entropy(self.train.cpu())
        self.vocab_size = len(VOCAB)

    def _windows(self, stream, starts, seq_len):
        offsets = torch.arange(seq_len + 1, device=stream.device)
        chunk = stream[starts[:, None] + offsets].long()
        return chunk[:, :-1], chunk[:, 1:]

    def train_batches(self, steps, batch, seq_len, seed):
        """`steps` (inputs, targets) pairs of [batch, seq_len] windows at random offsets."""
        # Its own generator: NVFP4's stochastic rounding draws from the default one, which must
        # not change the data order. All offsets are drawn up front and moved to the device
        # once, so a step costs no host-to-device copy.
        gen = torch.Generator().manual_seed(seed)
        high = self.train.numel() - seq_len - 1
        starts = torch.randint(0, high, (steps, batch), generator=gen).to(self.train.device)
        for i in range(steps):
            yield self._windows(self.train, starts[i], seq_len)

    def val_batches(self, num_batches, batch, seq_len):
        total = num_batches * batch
        high = self.val.numel() - seq_len - 1
        starts = torch.linspace(0, high, total).long().to(self.val.device)  # evenly spread
        return [self._windows(self.val, starts[i * batch:(i + 1) * batch], seq_len)
                for i in range(num_batches)]


def chars_needed(steps, batch, seq_len, cap):
    """Training characters to generate: one pass over the windows drawn, at most `cap` (past it
    the stream is sampled with repetition, which the validation loss would show as overfitting)."""
    return int(min(max(steps * batch * seq_len, 50_000), cap))


__all__ = ["VOCAB", "Corpus", "chars_needed", "decode", "encode", "generate_text",
           "unigram_entropy"]
