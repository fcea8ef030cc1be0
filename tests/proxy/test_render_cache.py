"""The renderer's per-turn encode cache (`proxy.encode_cache_chars`, 64M chars by default) is
compact: ~3 bytes a cached char with ids as C ints, not ~11 with lists of Python ints (a full
default cache was ~0.7 GB of proxy memory; benchmarks/scale_bench.py's soak saw it as growth),
gives the tokenizer's own ids on a hit as on a miss, and counts each chunk once."""

import gc
import random
import tracemalloc

import pytest

from gyre.backends.models.tokenizer import load_tokenizer
from gyre.proxy.render import ChatRenderer

WORDS = ["def", "return", "self", "import", "numpy", "the", "file", "src/main.py", "error:", "Traceback", "x = y + 1", "\n", "    "]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _texts(n, seed=0, words=300):
    rng = random.Random(seed)
    return ["<|im_start|>user\n" + " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(words)) for _ in range(n)]


def test_cached_turns_cost_at_most_five_bytes_a_char(tokenizer):
    r = ChatRenderer(tokenizer, cache_chars=64 << 20)
    texts = _texts(300)
    gc.collect()
    tracemalloc.start()
    try:
        for t in texts:
            r.encode(t)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert r._cache_chars == sum(len(t) for t in texts)
    assert held / r._cache_chars <= 5.0, f"{held / r._cache_chars:.1f} bytes per cached char"


def test_a_hit_gives_the_tokenizers_ids(tokenizer):
    r = ChatRenderer(tokenizer, cache_chars=64 << 20)
    for t in _texts(20, seed=1, words=50):
        want = tokenizer.backend_tokenizer.encode(t, add_special_tokens=False).ids
        miss = r.encode(t)
        hit = r.encode(t)
        assert miss == want
        assert hit == want and isinstance(hit, list)


def test_a_chunk_is_counted_once_and_the_limit_holds(tokenizer):
    texts = _texts(40, seed=2, words=40)
    limit = sum(len(t) for t in texts) // 2
    r = ChatRenderer(tokenizer, cache_chars=limit)
    for t in texts + texts[:5]:
        r.encode(t)
        r._put(t, [1, 2, 3])  # a second encoder thread missing the same chunk: already cached
        assert r._cache_chars == sum(len(c) for c in r._cache) <= limit
