-- Canaries by slot: a version that runs instead of a handler's current one
-- on some slots of its topology, until it is promoted or rolled back. At
-- most one canary of a handler is live (ended_at IS NULL); ended ones stay
-- as their history, with how and why they ended.
CREATE TABLE IF NOT EXISTS weir_handler_canaries (
    id         bigserial   PRIMARY KEY,
    name       text        NOT NULL,
    digest     text        NOT NULL,
    slots      integer[]   NOT NULL,
    thresholds jsonb       NOT NULL DEFAULT '{}',
    grants     jsonb       NOT NULL DEFAULT '{}',
    node       text        NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    ended_at   timestamptz,
    outcome    text,
    reason     text,
    FOREIGN KEY (name, digest) REFERENCES weir_handler_versions (name, digest)
);

CREATE UNIQUE INDEX IF NOT EXISTS weir_handler_canaries_live
    ON weir_handler_canaries (name) WHERE ended_at IS NULL;

-- What each node's calls of a canary and of the stable version did since the
-- canary began (cumulative, written by the node every second while the
-- canary runs): the cluster's comparison is their sum.
CREATE TABLE IF NOT EXISTS weir_handler_canary_tallies (
    canary  bigint      NOT NULL REFERENCES weir_handler_canaries (id) ON DELETE CASCADE,
    node    text        NOT NULL,
    canary_tally jsonb  NOT NULL,
    stable_tally jsonb  NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (canary, node)
);
