"""The state store of several orchestrator replicas behind one URL: Redis.

Every replica holds a `RedisStore` on the same Redis database. What must not race is one Lua script (Redis runs
a script without interleaving anything else): an idempotency key is claimed with the job it starts, a job is
claimed by one replica, a lost job is failed only while its replica is still dead, and a fenced write checks its
token in the same step as it writes. Plain writes are MULTI/EXEC transactions, so a record and its index entries
change together.

Layout under `prefix` (default "orchard:"):

    sandboxes          hash  sandbox id -> record JSON (without the heartbeat)
    beats              hash  sandbox id -> last heartbeat (a field of its own: a touch never rewrites a record)
    snapshots          hash  snapshot id -> record JSON
    job:<id>           hash  data (record JSON), status, replica
    jobs:active        set   ids of queued and running jobs (what `mark_lost_jobs` reads)
    jobs:done          zset  ids of finished jobs by completed_at (what retention deletes)
    idem:<key>         hash  the IdempotencyRecord's fields that are not None, as strings
    idem:created       zset  keys by created_at
    replica:<id>       string, expires with the replica's lease
    lock:<name>        string holding the fencing token, expires with the lease
    fence:<name>       the last token given for <name> (INCR: tokens only grow)

Leases run on the Redis server's clock (PX expiry): replicas need not agree on the time.
"""

from __future__ import annotations

import json
from typing import Any

from orchard._extras import requires_extra
from orchard.env.store.base import LOST_JOB_ERROR, IdempotencyRecord, JobRecord, SandboxRecord, SnapshotRecord

with requires_extra("redis"):
    import redis.asyncio as aioredis

_PUT_JOB_IF = """
-- KEYS: job, jobs:active, jobs:done, [gate]. ARGV: data, status, replica, completed_at ('' = none),
-- want_status, want_replica, gate_mode, gate_value.
-- Writes the job only while it has want_status and want_replica, and the gate holds: gate_mode 'lock' = the
-- key holds gate_value (a fencing token); 'dead' = the key does not exist (a replica whose lease ended).
local cur = redis.call('HMGET', KEYS[1], 'status', 'replica')
if cur[1] ~= ARGV[5] or (cur[2] or '') ~= ARGV[6] then return 0 end
if ARGV[7] == 'lock' and redis.call('GET', KEYS[4]) ~= ARGV[8] then return 0 end
if ARGV[7] == 'dead' and redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'data', ARGV[1], 'status', ARGV[2], 'replica', ARGV[3])
if ARGV[4] == '' then
  redis.call('SADD', KEYS[2], KEYS[1]); redis.call('ZREM', KEYS[3], KEYS[1])
else
  redis.call('SREM', KEYS[2], KEYS[1]); redis.call('ZADD', KEYS[3], ARGV[4], KEYS[1])
end
return 1
"""

_SANDBOX_IF = """
-- KEYS: sandboxes, beats. ARGV: sandbox id, want_status, want_replica ('' = none), data ('' = delete), beat.
-- Writes (or deletes) the record only while the stored one has want_status and want_replica.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local record = cjson.decode(cur)
local replica = record['replica']
if replica == cjson.null or replica == nil then replica = '' end
if record['status'] ~= ARGV[2] or replica ~= ARGV[3] then return 0 end
if ARGV[4] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1]); redis.call('HDEL', KEYS[2], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[4]); redis.call('HSET', KEYS[2], ARGV[1], ARGV[5])
end
return 1
"""

_CREATE_JOB = """
-- KEYS: job, jobs:active, idem:<key> ('' args when no key), idem:created, sandboxes, beats.
-- ARGV: data, status, replica, claim JSON ('' = no claim), sandbox id, touched_at ('' = no touch).
if ARGV[4] ~= '' then
  if redis.call('EXISTS', KEYS[3]) == 1 then return redis.call('HGETALL', KEYS[3]) end
  local claim = cjson.decode(ARGV[4])
  for field, value in pairs(claim) do redis.call('HSET', KEYS[3], field, value) end
  redis.call('ZADD', KEYS[4], claim['created_at'], KEYS[3])
end
redis.call('HSET', KEYS[1], 'data', ARGV[1], 'status', ARGV[2], 'replica', ARGV[3])
redis.call('SADD', KEYS[2], KEYS[1])
if ARGV[6] ~= '' and redis.call('HEXISTS', KEYS[5], ARGV[5]) == 1 then
  redis.call('HSET', KEYS[6], ARGV[5], ARGV[6])
end
return false
"""

_CLAIM_IDEMPOTENCY = """
-- KEYS: idem:<key>, idem:created. ARGV: claim JSON. SET NX of the whole record: new -> nil, else the existing one.
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HGETALL', KEYS[1]) end
local claim = cjson.decode(ARGV[1])
for field, value in pairs(claim) do redis.call('HSET', KEYS[1], field, value) end
redis.call('ZADD', KEYS[2], claim['created_at'], KEYS[1])
return false
"""

_TOUCH = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""

_DELETE_DONE_BEFORE = """
-- KEYS: a zset of record keys by time. ARGV: before (exclusive). Deletes the records and their entries.
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])
for _, key in ipairs(old) do redis.call('DEL', key) end
if #old > 0 then redis.call('ZREM', KEYS[1], unpack(old)) end
return #old
"""

_COMPLETE_IDEMPOTENCY = """
-- only a key that still exists: a late completion must not bring back a key that retention deleted
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'status_code', ARGV[1], 'response', ARGV[2])
return 1
"""

_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return false end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], token, 'PX', ARGV[1])
return token
"""

_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""

_INSERT_SNAPSHOT = """
-- KEYS: snapshots. ARGV: snapshot id, data, limit ('' = none). HSETNX bounded by the hash's length.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 'exists' end
if ARGV[3] ~= '' and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 'full' end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 'inserted'
"""

def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _claim_json(record: IdempotencyRecord) -> str:
    # Every value as a string: Lua's cjson re-encodes numbers with 14 digits, which would round created_at.
    return json.dumps({k: str(v) for k, v in vars(record).items() if v is not None})


def _claim_from(flat: list[str] | dict[str, str]) -> IdempotencyRecord:
    fields = dict(zip(flat[::2], flat[1::2], strict=True)) if isinstance(flat, list) else flat
    status = fields.get("status_code")
    return IdempotencyRecord(key=fields["key"], fingerprint=fields["fingerprint"],
                             created_at=float(fields["created_at"]), resource_id=fields.get("resource_id"),
                             status_code=int(status) if status is not None else None,
                             response=fields.get("response"))


class RedisStore:
    """`StateStore` on a Redis database, shared by every orchestrator replica that uses the same `url` and
    `prefix`.

    Args:
        url: `redis://host:port/db` (also `rediss://` and `unix://`, as `redis.asyncio.Redis.from_url` takes).
        prefix: every key starts with it, so that several services can share one database.
    """

    shared = True
    # BusyLoadingError (a server still loading its data after a restart) is a ConnectionError
    unavailable_errors: tuple[type[Exception], ...] = (aioredis.ConnectionError, aioredis.TimeoutError)

    def __init__(self, url: str, *, prefix: str = "orchard:") -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must be a redis://host:port/db URL, got {url!r}")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a str, got {prefix!r}")
        self.url, self.prefix = url, prefix
        self._r = aioredis.Redis.from_url(url, decode_responses=True)
        self._put_job_if = self._r.register_script(_PUT_JOB_IF)
        self._sandbox_if = self._r.register_script(_SANDBOX_IF)
        self._create_job = self._r.register_script(_CREATE_JOB)
        self._claim_idem = self._r.register_script(_CLAIM_IDEMPOTENCY)
        self._complete_idem = self._r.register_script(_COMPLETE_IDEMPOTENCY)
        self._touch = self._r.register_script(_TOUCH)
        self._delete_before = self._r.register_script(_DELETE_DONE_BEFORE)
        self._acquire = self._r.register_script(_ACQUIRE)
        self._renew = self._r.register_script(_RENEW)
        self._release = self._r.register_script(_RELEASE)
        self._insert_snapshot = self._r.register_script(_INSERT_SNAPSHOT)
        p = prefix
        self._sandboxes, self._beats = p + "sandboxes", p + "beats"
        self._snapshots = p + "snapshots"
        self._active, self._done = p + "jobs:active", p + "jobs:done"
        self._idem_created = p + "idem:created"

    def _job(self, job_id: str) -> str:
        return f"{self.prefix}job:{job_id}"

    def _idem(self, key: str) -> str:
        return f"{self.prefix}idem:{key}"

    # sandboxes
    def _sandbox(self, data: str, beat: str | None) -> SandboxRecord:
        record = SandboxRecord(**json.loads(data))
        if beat is not None:
            record.last_heartbeat = float(beat)
        return record

    async def put_sandbox(self, record: SandboxRecord) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(self._sandboxes, record.sandbox_id, json.dumps(vars(record)))
            pipe.hset(self._beats, record.sandbox_id, repr(record.last_heartbeat))
            await pipe.execute()

    async def insert_sandbox(self, record: SandboxRecord) -> bool:
        if not await self._r.hsetnx(self._sandboxes, record.sandbox_id, json.dumps(vars(record))):
            return False
        await self._r.hset(self._beats, record.sandbox_id, repr(record.last_heartbeat))
        return True

    async def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hget(self._sandboxes, sandbox_id)
            pipe.hget(self._beats, sandbox_id)
            data, beat = await pipe.execute()
        return self._sandbox(data, beat) if data is not None else None

    async def list_sandboxes(self) -> list[SandboxRecord]:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._sandboxes)
            pipe.hgetall(self._beats)
            records, beats = await pipe.execute()
        return [self._sandbox(records[k], beats.get(k)) for k in sorted(records)]

    async def delete_sandbox(self, sandbox_id: str) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hdel(self._sandboxes, sandbox_id)
            pipe.hdel(self._beats, sandbox_id)
            await pipe.execute()

    async def put_sandbox_if(self, record: SandboxRecord, *, status: str, replica: str | None) -> bool:
        args = [record.sandbox_id, status, replica or "", json.dumps(vars(record)), repr(record.last_heartbeat)]
        return bool(await self._sandbox_if(keys=[self._sandboxes, self._beats], args=args))

    async def delete_sandbox_if(self, sandbox_id: str, *, status: str, replica: str | None) -> bool:
        args = [sandbox_id, status, replica or "", "", ""]
        return bool(await self._sandbox_if(keys=[self._sandboxes, self._beats], args=args))

    async def touch_sandbox(self, sandbox_id: str, last_heartbeat: float) -> bool:
        return bool(await self._touch(keys=[self._sandboxes, self._beats], args=[sandbox_id, repr(last_heartbeat)]))

    # snapshots
    async def insert_snapshot(self, record: SnapshotRecord, *, limit: int | None = None) -> str:
        args = [record.snapshot_id, json.dumps(vars(record)), "" if limit is None else str(limit)]
        return str(await self._insert_snapshot(keys=[self._snapshots], args=args))

    async def put_snapshot(self, record: SnapshotRecord) -> None:
        await self._r.hset(self._snapshots, record.snapshot_id, json.dumps(vars(record)))

    async def get_snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        data = await self._r.hget(self._snapshots, snapshot_id)
        return SnapshotRecord(**json.loads(data)) if data is not None else None

    async def list_snapshots(self) -> list[SnapshotRecord]:
        records = await self._r.hgetall(self._snapshots)
        return [SnapshotRecord(**json.loads(records[k])) for k in sorted(records)]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._r.hdel(self._snapshots, snapshot_id)

    # jobs
    @staticmethod
    def _job_args(record: JobRecord) -> list[Any]:
        return [json.dumps(vars(record)), record.status, record.replica or ""]

    async def put_job(self, record: JobRecord) -> None:
        key = self._job(record.job_id)
        async with self._r.pipeline(transaction=True) as pipe:
            data, status, replica = self._job_args(record)
            pipe.hset(key, mapping={"data": data, "status": status, "replica": replica})
            if record.completed_at is None:
                pipe.sadd(self._active, key)
                pipe.zrem(self._done, key)
            else:
                pipe.srem(self._active, key)
                pipe.zadd(self._done, {key: record.completed_at})
            await pipe.execute()

    async def get_job(self, job_id: str) -> JobRecord | None:
        data = await self._r.hget(self._job(job_id), "data")
        return JobRecord(**json.loads(data)) if data is not None else None

    async def _jobs(self, keys: list[str]) -> list[JobRecord]:
        if not keys:
            return []
        async with self._r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hget(key, "data")
            rows = await pipe.execute()
        return [JobRecord(**json.loads(data)) for data in rows if data is not None]

    async def list_jobs(self, statuses: tuple[str, ...] | None = None) -> list[JobRecord]:
        if statuses is not None and set(statuses) <= {"queued", "running"}:
            keys = sorted(await self._r.smembers(self._active))
        else:
            keys = sorted([k async for k in self._r.scan_iter(match=self._job("*"), count=1000)])
        jobs = await self._jobs(keys)
        return jobs if statuses is None else [j for j in jobs if j.status in statuses]

    async def delete_jobs_completed_before(self, before: float) -> int:
        return int(await self._delete_before(keys=[self._done], args=[repr(before)]))

    async def claim_job(self, job_id: str, replica: str, started_at: float) -> bool:
        job = await self.get_job(job_id)
        if job is None or job.status != "queued":
            return False
        # `job` stays current until the script runs: a queued job changes only by a claim or a loss, and both
        # are this same compare-and-set on its status and replica.
        wanted = job.replica or ""
        job.status, job.replica, job.started_at = "running", replica, started_at
        return bool(await self._put_job_if(keys=[self._job(job_id), self._active, self._done],
                                           args=[*self._job_args(job), "", "queued", wanted, "none", ""]))

    async def mark_lost_jobs(self, completed_at: float) -> list[str]:
        jobs = await self._jobs(sorted(await self._r.smembers(self._active)))
        replicas = sorted({j.replica for j in jobs if j.replica})
        beats = await self._r.mget([self._replica(r) for r in replicas]) if replicas else []
        alive = dict(zip(replicas, beats, strict=True))
        lost = []
        for job in jobs:
            if job.status not in ("queued", "running") or (job.replica and alive.get(job.replica) is not None):
                continue
            was, gate = job.status, self._replica(job.replica or "")
            job.error = LOST_JOB_ERROR.format(status=was)
            job.status, job.completed_at = "failed", completed_at
            args = [*self._job_args(job), repr(completed_at), was, job.replica or "", "dead", ""]
            if await self._put_job_if(keys=[self._job(job.job_id), self._active, self._done, gate], args=args):
                lost.append(job.job_id)
        return lost

    # replicas and locks
    def _replica(self, replica: str) -> str:
        return f"{self.prefix}replica:{replica}"

    async def register_replica(self, replica: str, lease_s: float) -> None:
        await self._r.set(self._replica(replica), "alive", px=_ms(lease_s))

    async def replica_alive(self, replica: str) -> bool:
        return bool(await self._r.exists(self._replica(replica)))

    async def acquire_lock(self, name: str, lease_s: float) -> int | None:
        token = await self._acquire(keys=[f"{self.prefix}lock:{name}", f"{self.prefix}fence:{name}"],
                                    args=[_ms(lease_s)])
        return int(token) if token is not None else None

    async def renew_lock(self, name: str, token: int, lease_s: float) -> bool:
        return bool(await self._renew(keys=[f"{self.prefix}lock:{name}"], args=[str(token), _ms(lease_s)]))

    async def release_lock(self, name: str, token: int) -> None:
        await self._release(keys=[f"{self.prefix}lock:{name}"], args=[str(token)])

    async def put_job_fenced(self, record: JobRecord, lock: str, token: int) -> bool:
        done = repr(record.completed_at) if record.completed_at is not None else ""
        keys = [self._job(record.job_id), self._active, self._done, f"{self.prefix}lock:{lock}"]
        args = [*self._job_args(record), done, "running", record.replica or "", "lock", str(token)]
        return bool(await self._put_job_if(keys=keys, args=args))

    # idempotency
    async def claim_idempotency(self, record: IdempotencyRecord) -> IdempotencyRecord | None:
        existing = await self._claim_idem(keys=[self._idem(record.key), self._idem_created],
                                          args=[_claim_json(record)])
        return _claim_from(existing) if existing else None

    async def create_job_idempotent(
        self, job: JobRecord, claim: IdempotencyRecord | None, *, touched_at: float | None = None
    ) -> IdempotencyRecord | None:
        keys = [self._job(job.job_id), self._active, self._idem(claim.key) if claim else self._idem(""),
                self._idem_created, self._sandboxes, self._beats]
        args = [*self._job_args(job), _claim_json(claim) if claim else "", job.sandbox_id,
                repr(touched_at) if touched_at is not None else ""]
        existing = await self._create_job(keys=keys, args=args)
        return _claim_from(existing) if existing else None

    async def complete_idempotency(self, key: str, status_code: int, response: str) -> None:
        await self._complete_idem(keys=[self._idem(key)], args=[str(status_code), response])

    async def get_idempotency(self, key: str) -> IdempotencyRecord | None:
        fields = await self._r.hgetall(self._idem(key))
        return _claim_from(fields) if fields else None

    async def list_idempotency(self, pending_only: bool = False) -> list[IdempotencyRecord]:
        keys = await self._r.zrange(self._idem_created, 0, -1)
        if not keys:
            return []
        async with self._r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            rows = await pipe.execute()
        records = [_claim_from(fields) for fields in rows if fields]
        return [r for r in records if r.status_code is None] if pending_only else records

    async def delete_idempotency(self, key: str) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(self._idem(key))
            pipe.zrem(self._idem_created, self._idem(key))
            await pipe.execute()

    async def delete_idempotency_before(self, before: float) -> int:
        return int(await self._delete_before(keys=[self._idem_created], args=[repr(before)]))

    def check_reachable(self, timeout_s: float = 5.0) -> None:
        """Raise ``ConnectionError`` (an ``OSError``, one line) unless the server answers a PING within
        ``timeout_s``: a service whose store is down says so before it starts, not in its start-up's traceback.
        The message names the host and port, never the URL (it may hold a password)."""
        import redis

        client = redis.Redis.from_url(self.url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            client.ping()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise ConnectionError(f"cannot reach the Redis store (--store): {' '.join(str(exc).split())}") from None
        finally:
            client.close()

    async def close(self) -> None:
        await self._r.aclose()
