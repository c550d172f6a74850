-- Migration 8 (v7 -> v8) changes nothing on PostgreSQL. On SQLite it writes
-- the CHECKs that list three or more values as OR chains (an IN list costs
-- SQLite an ephemeral table per checked statement); PostgreSQL evaluates an
-- IN list in place, so its schema keeps them. The number is shared, so both
-- engines report the same schema version.
SELECT 1;
