-- The key that seals Weir's own headers (weir::seal): one per cluster, made
-- by the first node or command that needs it, read by the others.
CREATE TABLE IF NOT EXISTS weir_seal_key (
    id  integer PRIMARY KEY CHECK (id = 1),
    key bytea   NOT NULL
);
