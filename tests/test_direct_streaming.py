"""Direct streaming (`server.direct_streaming`): the LLMServer replicas serve the API themselves.

Real Serve apps on the session's Ray: SmolLM2 answering over the openai client
and gRPC stubs exactly as the app with an Ingress in front does, and a slow
null engine for the replica's own admission bound (429) and for a client that
walks away mid-stream.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
from ray import serve

from serve_app.config import ConfigError, parse_config
from serve_app.protos import seekserve_pb2 as pb
from serve_app.protos import seekserve_pb2_grpc as pb_grpc
from tests.conftest import ADMIN_TOKEN, deploy_app, null_config, smol_config, wait_for

QUESTION = "What is the capital of France? Answer in one word."


def direct(cfg: dict, **variant) -> dict:
    cfg["models"][0]["variants"][0].update(variant)
    return {**cfg, "server": {"direct_streaming": True}, "rollout": {"enabled": False}}


@pytest.fixture(scope="module")
def smol_direct(serve_session):
    deploy_app(direct(smol_config("smol-direct", max_num_seqs=8)), name="smoldirect", route_prefix="/smoldirect")
    yield {"app": "smoldirect", "base": serve_session["base"] + "/smoldirect", "model": "smol-direct"}
    serve.delete("smoldirect")


@pytest.fixture(scope="module")
def slow_direct(serve_session):
    # the engine would take 16 at once; the variant's bound (1 running + 1 queued) is what refuses
    cfg = direct(null_config("slow-direct", num_tokens=30, tokens_per_s=20, max_num_seqs=8, max_waiting_requests=8),
                 max_ongoing_requests=1)
    cfg["timeouts"] = {"retry_after_s": 3}
    deploy_app(cfg, name="slowdirect", route_prefix="/slowdirect")
    yield serve_session["base"] + "/slowdirect"
    serve.delete("slowdirect")


def stats(base: str) -> dict:
    r = httpx.get(base + "/admin/engine-stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return next(iter(r.json().values()))


def test_one_deployment_answers_as_the_app_with_an_ingress(smol_direct, smol_app):
    # no Ingress: the LLMServer deployment is the app's ingress
    deployments = serve.status().applications["smoldirect"].deployments
    assert list(deployments) == ["LLMServer-smol-direct-stable"]
    answers = []
    for app in (smol_direct, smol_app):
        c = openai.OpenAI(base_url=app["base"] + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = dict(model=app["model"], messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=16)
        whole = c.chat.completions.create(**ask)
        streamed = "".join(ch.choices[0].delta.content or ""
                           for ch in c.chat.completions.create(**ask, stream=True) if ch.choices)
        assert streamed == whole.choices[0].message.content
        answers.append((whole.choices[0].message.content, whole.usage.completion_tokens))
    assert answers[0] == answers[1] and "Paris" in answers[0][0]


def test_grpc_and_bad_input_through_the_replica(smol_direct, serve_session):
    with grpc.insecure_channel(f"127.0.0.1:{serve_session['grpc_port']}") as ch:
        stub, md = pb_grpc.InferenceStub(ch), (("application", smol_direct["app"]),)
        req = pb.GenerateRequest(model=smol_direct["model"], prompt="The three primary colours are", max_tokens=12,
                                 temperature=0)
        unary = stub.Generate(req, metadata=md, timeout=120)
        msgs = list(stub.GenerateStream(req, metadata=md, timeout=120))
        assert "".join(m.text for m in msgs) == unary.text and unary.usage.completion_tokens == 12
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(model="nope", prompt="hi"), metadata=md, timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    r = httpx.post(smol_direct["base"] + "/v1/chat/completions",
                   json={"model": smol_direct["model"], "messages": [], "temperature": 9}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the replica's own surface (engine stats for /admin and /ready) is served in the same process
    s = stats(smol_direct["base"])
    assert s["generated_tokens"] > 0 and s["num_running"] == 0
    assert httpx.get(smol_direct["base"] + "/ready", timeout=30).json()["variants"] == ["smol-direct/stable"]


def test_past_the_variants_bound_the_replica_answers_429(slow_direct):
    body = {"model": "slow-direct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}

    async def fire(n: int):
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*[c.post(slow_direct + "/v1/chat/completions", json=body) for _ in range(n)])

    rs = asyncio.run(fire(6))
    codes = sorted(r.status_code for r in rs)
    assert codes == [200, 200, 429, 429, 429, 429], codes
    rejected = next(r for r in rs if r.status_code == 429)
    assert rejected.headers["retry-after"] == "3"
    err = rejected.json()["error"]
    assert err["type"] == "rate_limit_error" and "in flight" in err["message"]
    # every admitted request gave its place back: two at once are admitted again
    assert [r.status_code for r in asyncio.run(fire(2))] == [200, 200]


def test_a_client_that_leaves_mid_stream_stops_the_engine_and_frees_its_place(slow_direct):
    before = stats(slow_direct)
    body = {"model": "slow-direct", "prompt": "hi", "max_tokens": 30, "stream": True}
    with httpx.stream("POST", slow_direct + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(ln for ln in r.iter_lines() if ln.startswith("data: {"))
    after = wait_for(lambda: (s := stats(slow_direct))["aborted_requests"] > before["aborted_requests"]
                     and s["num_running"] == 0 and s, timeout_s=30)
    assert after["generated_tokens"] - before["generated_tokens"] < 30

    async def two():
        async with httpx.AsyncClient(timeout=60) as c:
            b = {"model": "slow-direct", "prompt": "hi", "max_tokens": 3}
            return await asyncio.gather(*[c.post(slow_direct + "/v1/completions", json=b) for _ in range(2)])

    assert [r.status_code for r in asyncio.run(two())] == [200, 200]


def test_a_stream_cancelled_between_messages_closes_its_generator_at_once():
    """The consumer that stops while the generator waits at a yield (no ``__anext__`` under way to
    cancel) must still end it now, so the engine's request is aborted then and not at collection."""
    from serve_app.deployments.direct import _LocalStream

    closed = []

    async def messages():
        try:
            for i in range(100):
                yield i
        finally:
            closed.append(True)

    async def consume():
        gen = _LocalStream(messages())
        assert await gen.__anext__() == 0
        gen.cancel()
        await asyncio.sleep(0)  # one turn of the loop, and the close has run
        # checked here: once asyncio.run returns it has closed every generator left open anyway
        assert closed == [True]
        gen.cancel()  # a second cancel, of a closed generator, is harmless

    asyncio.run(consume())


@pytest.mark.parametrize("change, message", [
    (lambda c: c["models"][0]["variants"].append(
        {"name": "canary", "weight": 0, "engine": {"backend": "null"}}), "exactly one model with one variant"),
    (lambda c: c.update(rollout={"enabled": True}), "rollout.enabled: false"),
    (lambda c: c["server"].update(ingress_replicas=2), "no Ingress deployment"),
    (lambda c: (c.update(auth={"mode": "api_keys"}), c["models"][0]["variants"][0].update(
        autoscaling={"min_replicas": 1, "max_replicas": 2})), "autoscales"),
])
def test_configs_it_cannot_serve_are_refused(change, message):
    cfg = direct(null_config("m"))
    cfg["models"][0]["variants"][0]["weight"] = 100
    change(cfg)
    with pytest.raises(ConfigError, match=message):
        parse_config(cfg)
