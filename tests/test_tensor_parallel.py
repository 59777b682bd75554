"""hf backend with tensor_parallel_size 3 on a real Ray Serve app: SmolLM2-135M
(9 attention heads, 3 KV heads) split over three gloo ranks, each a worker in
the replica's placement group, answers token for token what one rank answers
(the session's TP=1 SmolLM2 app). A rank that dies takes its replica out of
service and Serve brings up a new one."""

import os
import signal

import httpx
import pytest
from ray import serve

from serve_app.app import llm_deployment_name
from tests.conftest import deploy_app, wait_for

MODEL = "smol-tp"
APP = "tp"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write one sentence about the sea."]


def variant(name, weight, tp):
    return {"name": name, "weight": weight, "tensor_parallel_size": tp, "resources": {"num_cpus": 0.5},
            "engine": {"backend": "hf", "options": {"device": "cpu", "max_num_seqs": 4, "max_model_len": 512,
                                                    "num_threads": 1}}}


@pytest.fixture(scope="module")
def tp_app(serve_session, smol_app):
    deploy_app({"models": [{"name": MODEL, "variants": [variant("tp3", 100, 3)]}]}, name=APP, route_prefix="/tp")
    yield {"tp3": (serve_session["base"] + "/tp", MODEL), "tp1": (smol_app["base"], smol_app["model"])}
    serve.delete(APP)


def ask(app, which, question, max_tokens=24):
    base, model = app[which]
    return httpx.post(base + "/v1/chat/completions", timeout=180,
                      json={"model": model, "temperature": 0, "max_tokens": max_tokens, "logprobs": True,
                            "messages": [{"role": "user", "content": question}]})


def tokens(r):
    assert r.status_code == 200, r.text
    return [(t["token"], t["logprob"]) for t in r.json()["choices"][0]["logprobs"]["content"]]


def stats(variant_name="tp3"):
    return serve.get_deployment_handle(llm_deployment_name(MODEL, variant_name), APP).stats.remote().result()


@pytest.mark.slow
def test_tp3_places_each_rank_in_the_replicas_group(tp_app):
    s = stats("tp3")
    assert s["tensor_parallel_size"] == 3
    ranks = s["placement"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert len({r["pid"] for r in ranks}) == 3 and len({r["placement_group"] for r in ranks}) == 1
    assert {r["node_id"] for r in ranks} == {s["replica_node_id"]}


@pytest.mark.slow
def test_tp3_greedy_equals_tp1_token_for_token(tp_app):
    for q in QUESTIONS:
        one, three = tokens(ask(tp_app, "tp1", q)), tokens(ask(tp_app, "tp3", q))
        assert [t for t, _ in three] == [t for t, _ in one], q
        # the same numbers up to the order of float32 sums in the all-reduces
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(one, three)), (one, three)


@pytest.mark.slow
def test_tp3_batches_concurrent_requests(tp_app):
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda q: tokens(ask(tp_app, "tp3", q)), QUESTIONS + QUESTIONS[:1]))
    alone = [tokens(ask(tp_app, "tp1", q)) for q in QUESTIONS]
    for got, want in zip(together, alone + alone[:1]):
        assert [t for t, _ in got] == [t for t, _ in want]


@pytest.mark.slow
def test_a_lost_rank_takes_its_replica_out_and_serve_replaces_it(tp_app):
    before = stats("tp3")
    want = [t for t, _ in tokens(ask(tp_app, "tp1", QUESTIONS[0]))]
    os.kill(before["placement"][1]["pid"], signal.SIGKILL)
    r = ask(tp_app, "tp3", QUESTIONS[0])
    # the engine reports the failure as an error, not a hang or a half answer
    assert r.status_code >= 500 and "error" in r.json(), r.text

    def replaced():
        try:
            s = stats("tp3")
        except Exception:  # the replica is being replaced
            return None
        return s if s["replica_actor_id"] != before["replica_actor_id"] else None

    after = wait_for(replaced, timeout_s=240, interval_s=3)
    assert {r["pid"] for r in after["placement"]}.isdisjoint({r["pid"] for r in before["placement"]})
    got = wait_for(lambda: (r := ask(tp_app, "tp3", QUESTIONS[0])).status_code == 200 and r, timeout_s=60)
    assert [t for t, _ in tokens(got)] == want
