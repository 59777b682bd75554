"""The rollout controller: a detached Ray actor on the head node.

Thin glue around the pure parts: it feeds request samples into
:class:`~rollout.signals.SampleWindows`, runs :func:`rollout.state_machine.tick`
for every active rollout each ``tick_s``, persists state and audit rows in
SQLite, and publishes the traffic split to Ray's internal KV, where every
ingress replica picks it up (a split is one value: a request sees the old one
or the new one, never a mix). Restarted, it reloads from SQLite and resumes at
the same step with the same weights.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import ray

from rollout.analysis import evaluate
from rollout.plan import RolloutPlan
from rollout.signals import SampleWindows, samples_from_batch
from rollout.state_machine import TERMINAL, Event, RolloutCommandError, command, start, tick, weights
from rollout.store import RolloutStore

log = logging.getLogger("seekserve.rollout")

ACTOR_NAME = "seekserve-rollout-controller"
NAMESPACE = "seekserve"
KV_NAMESPACE = "seekserve"


def actor_name(app: str) -> str:
    return f"{ACTOR_NAME}-{app}"


def split_key(app: str, model: str) -> str:
    return f"splits/{app}/{model}"


class RolloutNotFound(KeyError):
    pass


class RolloutController:
    def __init__(self, app: str, db_path: str, variants: dict[str, list[str]], tick_s: float = 1.0,
                 window_max_age_s: float = 3600.0, replicas: dict[str, int | None] | None = None):
        self.app = app
        self.replicas = replicas or {}
        self.store = RolloutStore(db_path)
        self.variants = variants
        self.tick_s = tick_s
        self.windows = SampleWindows(window_max_age_s)
        self._lock = asyncio.Lock()
        self._task = None
        # after a restart the routers must converge on the persisted weights
        for plan, state in self.store.all():
            self._publish(plan, state)

    async def run(self) -> None:
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        # after a restart by Ray (max_restarts) nobody calls run(): any call starts the loop
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick_all()
            except Exception:  # one bad tick must not stop the controller
                log.exception("rollout tick failed")
            await asyncio.sleep(self.tick_s)

    async def tick_all(self, now: float | None = None) -> None:
        async with self._lock:
            now = time.time() if now is None else now
            rollouts = self.store.all()
            self._export_all(rollouts)
            for plan, state in rollouts:
                if state.phase in TERMINAL and state.scale_down_at_s is None:
                    continue

                def evaluator(gates, plan=plan):
                    return evaluate(gates, self.windows, plan.model, plan.stable, plan.canary, now)

                new, events = tick(plan, state, now, evaluator)
                if any(e.decision == "scale_down_canary" for e in events):
                    events = [self._scale_event(e, plan, 0) if e.decision == "scale_down_canary" else e
                              for e in events]
                if new.gates != state.gates:
                    self._export(plan, new, weights(plan, new, self.variants.get(plan.model, [])))
                if new != state or events:
                    self.store.save(plan, new, events, who="controller", at=now)
                    if new.canary_weight != state.canary_weight or new.phase != state.phase:
                        self._publish(plan, new)
                    for e in events:
                        log.info("rollout %s: %s: %s", plan.name, e.decision, e.reason)

    def _scale(self, plan: RolloutPlan, n: int | None) -> str:
        """Set the canary's replica count through Serve's external-scaler API."""
        if n is None:
            return "Serve autoscales this variant: replica count left to its policy"
        from ray.serve._private.common import DeploymentID
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        from serve_app.app import llm_deployment_name

        try:
            controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
            dep = DeploymentID(name=llm_deployment_name(plan.model, plan.canary), app_name=self.app)
            ray.get(controller.update_deployment_replicas.remote(dep, n), timeout=30)
            return f"{plan.canary} scaled to {n} replicas"
        except Exception as e:  # scaling is best effort: the weight is already 0
            return f"could not scale {plan.canary} to {n}: {type(e).__name__}: {e}"

    def _scale_event(self, e: Event, plan: RolloutPlan, n: int) -> Event:
        return Event(e.decision, f"{e.reason}; {self._scale(plan, n)}", e.gates)

    async def ingest(self, batch: list[tuple]) -> None:
        self._ensure_loop()
        for model, variant, s in samples_from_batch(batch):
            self.windows.add(model, variant, s)

    def _publish(self, plan: RolloutPlan, state) -> None:
        from ray.experimental import internal_kv

        w = weights(plan, state, self.variants.get(plan.model, [plan.stable, plan.canary]))
        self._export(plan, state, w)
        value = {"weights": w, "version": time.time_ns(), "rollout": plan.name, "phase": state.phase}
        internal_kv._internal_kv_put(split_key(self.app, plan.model), json.dumps(value).encode(),
                                     overwrite=True, namespace=KV_NAMESPACE)

    def _export_all(self, rollouts: list) -> None:
        """Every rollout's gauges are set again on each tick: a gauge set only once
        can miss Ray's export for good (the agent also evicts gauges it has not
        heard of for two export intervals), and a paused rollout changes nothing. A model's
        weights come from its active rollout, else the one whose step moved last,
        so a finished rollout never overwrites the live split."""
        current: dict[str, str] = {}  # model -> name of the rollout its weights come from
        for plan, state in sorted(rollouts, key=lambda r: (r[1].phase not in TERMINAL, r[1].step_started_s)):
            current[plan.model] = plan.name
        for plan, state in rollouts:
            w = weights(plan, state, self.variants.get(plan.model, [])) if current[plan.model] == plan.name else {}
            self._export(plan, state, w)

    def _export(self, plan: RolloutPlan, state, w: dict[str, int]) -> None:
        try:
            from serve_app import metrics

            for variant, weight in w.items():
                metrics.get("rollout_weight").set(weight, tags={"model": plan.model, "variant": variant})
            for phase in ("Progressing", "Paused", "Healthy", "Degraded", "Aborted"):
                metrics.get("rollout_phase").set(1.0 if state.phase == phase else 0.0,
                                                 tags={"model": plan.model, "rollout": plan.name, "phase": phase})
            for g in state.gates:
                if g.get("value") is not None:
                    metrics.get("gate").set(float(g["value"]),
                                            tags={"model": plan.model, "rollout": plan.name, "metric": g["metric"]})
        except Exception as e:  # metrics never break the controller
            log.debug("rollout metrics failed: %s", e)

    def _validate(self, plan: RolloutPlan) -> None:
        known = self.variants.get(plan.model)
        if known is None:
            raise ValueError(f"model {plan.model!r} is not served; served: {sorted(self.variants)}")
        for role, v in (("stable", plan.stable), ("canary", plan.canary)):
            if v not in known:
                raise ValueError(f"{role} variant {v!r} is not a variant of {plan.model!r}: {known}")

    async def start_rollout(self, plan_dict: dict, who: str) -> dict:
        self._ensure_loop()
        plan = RolloutPlan.model_validate(plan_dict)
        self._validate(plan)
        async with self._lock:
            for other, st in self.store.all():
                if other.model == plan.model and st.phase not in TERMINAL and other.name != plan.name:
                    raise RolloutCommandError(f"rollout {other.name!r} is already active on {plan.model!r}")
            existing = self.store.load(plan.name)
            if existing is not None and existing[1].phase not in TERMINAL:
                raise RolloutCommandError(f"rollout {plan.name!r} is already {existing[1].phase}")
            state = start(plan, time.time())
            restored = self._scale(plan, self.replicas.get(f"{plan.model}/{plan.canary}", 1))
            self.store.save(plan, state, [Event("start", f"started by {who}; {restored}")], who=who)
            self._publish(plan, state)
        await self.tick_all()
        return self._view(*self.store.load(plan.name))

    async def command(self, name: str, cmd: str, who: str, canary_weight: int | None = None) -> dict:
        self._ensure_loop()
        async with self._lock:
            got = self.store.load(name)
            if got is None:
                raise RolloutNotFound(name)
            plan, state = got
            new, events = command(plan, state, cmd, time.time(), canary_weight)
            if cmd == "retry":
                events = [self._scale_event(e, plan, self.replicas.get(f"{plan.model}/{plan.canary}", 1))
                          for e in events]
            self.store.save(plan, new, events, who=who)
            self._publish(plan, new)
        return self._view(plan, new)

    async def status(self, name: str | None = None) -> list[dict]:
        self._ensure_loop()
        if name is not None:
            got = self.store.load(name)
            if got is None:
                raise RolloutNotFound(name)
            return [self._view(*got)]
        return [self._view(p, s) for p, s in self.store.all()]

    async def history(self, name: str) -> list[dict]:
        if self.store.load(name) is None:
            raise RolloutNotFound(name)
        return self.store.history(name)

    def _view(self, plan, state) -> dict:
        return {"plan": plan.model_dump(), "state": state.to_dict(),
                "weights": weights(plan, state, self.variants.get(plan.model, [plan.stable, plan.canary]))}


def head_node_strategy():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = next(n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n["Resources"])
    return NodeAffinitySchedulingStrategy(node_id=head, soft=False)


def get_or_create(app: str, db_path: str, variants: dict[str, list[str]], tick_s: float = 1.0,
                  replicas: dict[str, int | None] | None = None):
    """The named controller of this cluster (created on the head node if absent)."""
    actor = ray.remote(RolloutController).options(
        name=actor_name(app), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_concurrency=64, scheduling_strategy=head_node_strategy(),
        # Ray restarts it after a crash; __init__ reloads every rollout from SQLite
        max_restarts=-1,
    ).remote(app, db_path, variants, tick_s, replicas=replicas)
    actor.run.remote()
    return actor


def read_split(app: str, model: str) -> dict | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(split_key(app, model), namespace=KV_NAMESPACE)
    return json.loads(raw) if raw else None
