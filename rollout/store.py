"""Rollout persistence in SQLite (WAL): current plan + state per rollout, and an
append-only audit log (who, when, step, weights, gate values, decision, reason).

Every state change and its audit rows are written in one transaction, so a
crash leaves either both or neither. The controller reloads from here after a
restart and resumes at the same step with the same weights.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from rollout.plan import RolloutPlan
from rollout.state_machine import Event, RolloutState

_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    name TEXT PRIMARY KEY,
    plan_json TEXT NOT NULL,
    state_json TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    rollout TEXT NOT NULL,
    at REAL NOT NULL,
    who TEXT NOT NULL,
    step INTEGER NOT NULL,
    phase TEXT NOT NULL,
    canary_weight INTEGER NOT NULL,
    decision TEXT NOT NULL,
    reason TEXT NOT NULL,
    gates_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_by_rollout ON audit (rollout, id);
CREATE TRIGGER IF NOT EXISTS audit_append_only_u BEFORE UPDATE ON audit
BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_append_only_d BEFORE DELETE ON audit
BEGIN SELECT RAISE(ABORT, 'audit log is append-only'); END;
"""


class RolloutStore:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def save(self, plan: RolloutPlan, state: RolloutState, events: list[Event], who: str,
             at: float | None = None) -> None:
        at = time.time() if at is None else at
        cur = self._db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            cur.execute(
                "INSERT INTO rollouts (name, plan_json, state_json, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET plan_json=excluded.plan_json, state_json=excluded.state_json, "
                "updated_at=excluded.updated_at",
                (plan.name, plan.model_dump_json(), json.dumps(state.to_dict()), at),
            )
            for e in events:
                cur.execute(
                    "INSERT INTO audit (rollout, at, who, step, phase, canary_weight, decision, reason, gates_json) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (plan.name, at, who, state.step_index, state.phase, state.canary_weight, e.decision, e.reason,
                     json.dumps([dict(g) for g in e.gates])),
                )
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise

    def load(self, name: str) -> tuple[RolloutPlan, RolloutState] | None:
        row = self._db.execute("SELECT plan_json, state_json FROM rollouts WHERE name = ?", (name,)).fetchone()
        if row is None:
            return None
        return RolloutPlan.model_validate_json(row[0]), RolloutState.from_dict(json.loads(row[1]))

    def all(self) -> list[tuple[RolloutPlan, RolloutState]]:
        rows = self._db.execute("SELECT plan_json, state_json FROM rollouts ORDER BY name").fetchall()
        return [(RolloutPlan.model_validate_json(p), RolloutState.from_dict(json.loads(s))) for p, s in rows]

    def history(self, name: str, limit: int = 1000) -> list[dict]:
        rows = self._db.execute(
            "SELECT id, at, who, step, phase, canary_weight, decision, reason, gates_json FROM audit "
            "WHERE rollout = ? ORDER BY id LIMIT ?", (name, limit)).fetchall()
        keys = ("id", "at", "who", "step", "phase", "canary_weight", "decision", "reason", "gates")
        return [dict(zip(keys, (*r[:-1], json.loads(r[-1])))) for r in rows]
