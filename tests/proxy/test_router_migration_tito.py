"""Through the proxy (OpenAI SDK → proxy → router → CPU engines): a sampled call drained
mid-stream and continued by KV migration leaves exactly the TITO record of the same call run
undisturbed (input ids, output ids, log-probs, versions, finish reason, response text)."""

import asyncio

import numpy as np
import openai

from gyre.backends.engines.cpu_engine import CpuEngine
from gyre.backends.transfer.migration import LocalKvTransport
from gyre.backends.models.tokenizer import VOCAB_SIZE
from gyre.proxy import ProxyConfig
from tests.backends.helpers import tiny_model
from tests.proxy.test_cpu_engine_proxy import DrainAfter


def _record_fields(rec):
    return (rec.input_ids.tolist(), rec.output_ids.tolist(), rec.output_logprobs.tolist(),
            rec.output_versions.tolist(), rec.finish_reason)


def test_migrated_call_leaves_the_undisturbed_tito_record(make_server):
    model = tiny_model(seed=0, vocab=VOCAB_SIZE)
    proxy, h = make_server(config=ProxyConfig(migration="always"))
    src = CpuEngine.from_model(model)
    src.name = "cpu-a"
    src.attach_kv_transport(LocalKvTransport("tito-a"))
    a = DrainAfter(src, "cpu-a", proxy.router, k=6)
    b = CpuEngine.from_model(model)
    b.name = "cpu-b"
    b.attach_kv_transport(LocalKvTransport("tito-b"))

    async def setup():
        await src.start()
        await b.start()
        proxy.router.add_engine(a, kind="cell", index=1)
        proxy.router.add_engine(b, kind="pool", index=0)
        proxy.router.slots["cpu-b"].served = 10**6  # first pick: A (least served among idle)

    h.call(setup())
    c = openai.OpenAI(base_url=h.url + "/v1", api_key=proxy.issue_key("ex-mig"), max_retries=0)
    msgs = [{"role": "user", "content": "Count to ten."}]
    ask = dict(model="m", messages=msgs, max_tokens=24, temperature=1.0, seed=11, extra_body={"min_tokens": 24})
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **ask) if ch.choices)
    migrated = proxy.sink.records[-1]
    assert a.fired and h.call(asyncio.wait_for(a.task, 30)) == 1
    assert migrated.payload_ref["engines"] == ["cpu-a", "cpu-b"]
    (rec,) = proxy.router.reroute_log
    assert rec.mode == "migrate" and rec.tokens_recomputed == 0
    again = c.chat.completions.create(**ask)  # the same call, undisturbed on B alone
    plain = proxy.sink.records[-1]
    assert plain.payload_ref["engines"] == ["cpu-b"]
    assert _record_fields(migrated) == _record_fields(plain)
    assert len(migrated.output_ids) == 24 and np.all(migrated.output_versions == 0)
    assert text == again.choices[0].message.content
