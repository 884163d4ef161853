-- handler.dedup: what each handler already handled, per (tenant, group,
-- message id), until expires_at (the database's clock). Empty tenant or
-- group: the message had none. Expired rows are deleted in chunks by the
-- nodes that write.
CREATE TABLE IF NOT EXISTS weir_dedup (
    tenant     text        NOT NULL,
    group_id   text        NOT NULL,
    message_id text        NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (tenant, group_id, message_id)
);
CREATE INDEX IF NOT EXISTS weir_dedup_expires_at ON weir_dedup (expires_at);
