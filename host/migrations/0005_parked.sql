-- on_failure = "park": the groups parked behind a failed head, per slot, so
-- the next owner of the slot keeps them parked. Empty tenant: none.
CREATE TABLE IF NOT EXISTS weir_parked (
    topology text        NOT NULL,
    slot     bigint      NOT NULL,
    tenant   text        NOT NULL,
    group_id text        NOT NULL,
    head_id  text        NOT NULL,
    since    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topology, slot, tenant, group_id)
);
