-- Handler versions deployed to a `postgres` cluster: every node serves the
-- latest activation of each handler. A version is a validated component,
-- identified by the sha256 of its bytes; an activation makes one current.
-- `previous` is the activation it replaced, so a rollback walks back the
-- chain of deploys (and a deploy after a rollback starts a new branch).

CREATE TABLE IF NOT EXISTS weir_handler_versions (
    name       text        NOT NULL,
    digest     text        NOT NULL,
    component  bytea       NOT NULL,
    size       bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, digest)
);

CREATE TABLE IF NOT EXISTS weir_handler_activations (
    seq      bigserial   PRIMARY KEY,
    name     text        NOT NULL,
    digest   text        NOT NULL,
    previous bigint      REFERENCES weir_handler_activations (seq),
    source   text        NOT NULL,
    node     text        NOT NULL,
    grants   jsonb       NOT NULL DEFAULT '{}',
    at       timestamptz NOT NULL DEFAULT now(),
    FOREIGN KEY (name, digest) REFERENCES weir_handler_versions (name, digest)
);

CREATE INDEX IF NOT EXISTS weir_handler_activations_by_name
    ON weir_handler_activations (name, seq DESC);
