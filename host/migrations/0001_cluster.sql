-- Weir's cluster registry (cluster.mode = "postgres"). Messages never touch
-- these tables: they hold nodes, leases, the leader lease and slot
-- assignments only. All lease arithmetic uses the database's clock (now()).

-- One row per running node process. A node that comes back after its lease
-- expired registers again with a new id.
CREATE TABLE IF NOT EXISTS weir_nodes (
    node_id     uuid        PRIMARY KEY,
    name        text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    renewed_at  timestamptz NOT NULL DEFAULT now(),
    lease_until timestamptz NOT NULL
);

-- The leader lease: a single row. Whoever holds an unexpired lease leads;
-- every leader action re-checks it inside its own transaction.
CREATE TABLE IF NOT EXISTS weir_leader (
    id          smallint    PRIMARY KEY CHECK (id = 1),
    node_id     uuid        NOT NULL,
    term        bigint      NOT NULL,
    lease_until timestamptz NOT NULL
);

-- Slot ownership. state: 'free' (no owner), 'assigned' (owner consumes it),
-- 'releasing' (owner asked to drain and give it up; target is the next
-- owner). epoch grows by one on every new assignment (fencing epoch).
CREATE TABLE IF NOT EXISTS weir_slots (
    topology    text        NOT NULL,
    slot        integer     NOT NULL,
    owner       uuid        NULL,
    epoch       bigint      NOT NULL DEFAULT 0,
    state       text        NOT NULL DEFAULT 'free' CHECK (state IN ('free', 'assigned', 'releasing')),
    target      uuid        NULL,
    changed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topology, slot)
);

CREATE INDEX IF NOT EXISTS weir_slots_owner ON weir_slots (owner);
