-- A node that stops marks itself `leaving` before it drains: the leader
-- never assigns a slot to a leaving node, and moves the slots it still owns
-- to the others as its drains end. The node keeps renewing its lease until
-- it has released every slot and deleted its row.
ALTER TABLE weir_nodes ADD COLUMN IF NOT EXISTS leaving boolean NOT NULL DEFAULT false;
