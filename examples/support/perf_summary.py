#!/usr/bin/env python3
"""Where payonce's CPU goes, from a `perf record --call-graph dwarf` of `bench`.

    perf script -i perf.data -F comm,tid,period,ip,sym > perf.txt
    python3 examples/support/perf_summary.py perf.txt            # payonce over HTTP
    python3 examples/support/perf_summary.py --bare perf.txt     # L_batch / A_batch

Every sample is one thread on a CPU. It is sorted by its thread's name
(`payonce-worker-N`, `payonce-io`, `bench-client-N`) and by the frames on
its stack: a worker is the writer while it runs `GroupCommitter::lead`
(src/store/sqlite/group_commit.rs), inside an operation's savepoint or
around the batch's COMMIT. Inside the SQL (the writer's operations, or
`BareSqlite::apply_batch` with --bare) the leaf function says what kind of
work it was. The shares are of all samples taken (with --bare, of those
inside the batches); a share times the CPU per payment of bench's own
table gives microseconds.
"""
import collections
import sys

# Kernel frames of going to sleep and waking another thread (exact names).
SLEEP_WAKE = {
    '__schedule', 'schedule', 'futex_wait', 'futex_wake', 'futex_do_wait', '__futex_wait', 'try_to_wake_up',
    'do_sched_yield', 'finish_task_switch.isra.0', 'wake_up_q', 'futex_wake_mark', 'schedule_hrtimeout_range',
    'do_epoll_wait', 'ep_poll',
}

# The leaf function of a sample inside the SQL, by kind (first match wins).
LEAF_KINDS = [
    ('malloc/free, SQLite global mutexes', (
        'malloc', 'free', '_int_', 'unlink_chunk', 'pthread_mutex', 'sqlite3_initialize', 'sqlite3DbMalloc',
        'sqlite3Malloc', 'sqlite3_free', 'sqlite3DbFree', 'measureAllocationSize', 'sqlite3_mutex', 'sqlite3StatusUp',
        'sqlite3StatusDown', 'mallocWithAlarm', 'sqlite3MemSize', 'realloc')),
    ('B-tree: search, insert, index keys, pages', (
        'Btree', 'btree', 'balance', 'Cell', 'moveTo', 'RecordCompare', 'vdbeRecordCompare', 'pcache', 'Pager', 'pager',
        'getPage', 'getAndInitPage', 'sqlite3VdbeIdx', 'memcmp', 'Overflow', 'freeSpace', 'allocateSpace', 'defragment',
        'assemblePage', 'editPage', 'rebuildPage', 'sqlite3VdbeRecordUnpack', 'sqlite3VdbeSerial', 'accessPayload',
        'clearCell', 'dropCell', 'cellSize', 'sqlite3Get4byte', 'sqlite3Put4byte', 'sqlite3GetVarint', 'sqlite3PutVarint',
        'findCell', 'decodeFlags', 'WalFindFrame', 'walFindFrame', 'moveToChild', 'moveToRoot', 'moveToLeftmost')),
    ('VDBE: opcodes, expressions, CHECKs, triggers', (
        'sqlite3Vdbe', 'vdbe', 'sqlite3Mem', 'sqlite3_value', 'sqlite3Value', 'sqlite3_result', 'sqlite3_column',
        'sqlite3_bind', 'sqlite3_step', 'sqlite3Step', 'sqlite3_reset', 'sqlite3Reset', 'sqlite3Strlen',
        'sqlite3_clear_bindings', 'invokeProfileCallback', 'sqlite3CloseSavepoints', 'sqlite3_sql', 'Mem')),
    ('Rust: payonce, rusqlite, JSON text, copies', ('payonce::', 'alloc::', 'core::', 'serde', 'rusqlite', 'mem', 'str', '<')),
]

COMMIT_FRAMES = (
    'CommitPhase', 'WalFrames', 'walFrames', 'Checkpoint', 'checkpoint', 'fsync', 'unixSync', 'walChecksum',
    'walIndexAppend', 'sqlite3WalEndWriteTransaction', 'vdbeCommit',
)


def samples(path):
    """(thread name, frames leaf first) per sample of `perf script -F comm,tid,period,ip,sym`."""
    comm, frames = None, []
    with open(path, errors='replace') as text:
        for line in text:
            if not line.strip():
                if comm is not None:
                    yield comm, frames
                comm, frames = None, []
            elif not line[0].isspace():
                comm = line.split()[0]
            else:
                parts = line.strip().split(None, 1)
                frames.append(parts[1] if len(parts) > 1 else parts[0])
    if comm is not None:
        yield comm, frames


def has(frames, *patterns):
    return any(p in f for f in frames for p in patterns)


def sleeps(frames):
    return any(f in SLEEP_WAKE for f in frames)


def leaf_kind(frames):
    leaf = frames[0] if frames else ''
    for kind, patterns in LEAF_KINDS:
        if any(p in leaf for p in patterns):
            return kind
    return 'kernel: page faults, interrupts'


def in_sql(frames):
    """Where a sample inside the SQL went: by who called (COMMIT, the
    savepoint's sub-journal, json_valid, a CHECK's function), else by the
    kind of its leaf."""
    if has(frames, *COMMIT_FRAMES):
        return 'COMMIT: WAL frames, checksums, checkpoint'
    if has(frames, 'subjournalPage', 'memjrnl', 'sqlite3BtreeSavepoint', 'sqlite3PagerSavepoint'):
        return "savepoint sub-journal: page copies and their malloc/free"
    if has(frames, 'jsonValidFunc', 'jsonParse', 'jsonTranslate'):
        return 'json_valid'
    if has(frames, 'patternCompare', 'globFunc', 'lengthFunc', 'typeofFunc', 'substrFunc'):
        return 'GLOB, length, typeof, substr (CHECKs)'
    return leaf_kind(frames)


def http(comm, frames):
    if has(frames, 'api::healthz', 'check_health'):
        return 'bench: GET /healthz when a client connects', None
    if comm.startswith('payonce-worker'):
        if has(frames, 'GroupCommitter::lead'):
            if has(frames, 'run_in_savepoint', 'GroupCommitter::run::{{closure}}'):
                return 'writer: the operations, in their savepoints', in_sql(frames)
            if has(frames, *COMMIT_FRAMES):
                return 'writer: COMMIT (WAL frames, checksums, checkpoint; the fsync waits off-CPU)', None
            if has(frames, 'Batch::end', 'Batch::publish', 'unpark') or sleeps(frames):
                return "writer: waking the batch's callers", None
            return 'writer: BEGIN, taking operations off the queue', None
        if sleeps(frames):
            return 'workers: going to sleep, waking others (futex, scheduler)', None
        if has(frames, 'SqliteEngine::read', 'Store::read'):
            return 'workers: duplicate check (read snapshot)', None
        if has(frames, 'check_storage', 'statx'):
            return 'workers: storage checks (statx)', None
        if has(frames, 'signature', 'hmac', 'sha2', 'Sha256'):
            return 'workers: signature (HMAC)', None
        if has(frames, 'GroupCommitter::run'):
            return 'workers: joining the writer queue', None
        if has(frames, 'oneshot', 'tokio'):
            return 'workers: handing the answer to the edge', None
        return 'workers: parse, route, render, log, metrics', None
    if comm.startswith('payonce-io'):
        if sleeps(frames):
            return 'edge: going to sleep, waking others (futex, epoll_wait, scheduler)', None
        if has(frames, 'tcp_', 'sock_', '__sys_sendto', '__sys_recvfrom', 'ksys_write', 'ksys_read', 'sendmsg', 'recvmsg'):
            return 'edge: socket reads and writes (TCP on loopback)', None
        return 'edge: hyper and tokio', None
    if comm.startswith('bench-client'):
        return 'bench: HTTP clients', None
    return 'other threads (' + comm + ')', None


def bare(comm, frames):
    if not has(frames, 'BareSqlite::apply_batch'):
        return 'outside the measured batches (setup, spinner, ...)', None
    if has(frames, 'apply_statements'):
        return 'the statements', in_sql(frames)
    if has(frames, *COMMIT_FRAMES):
        return 'COMMIT (WAL frames, checksums, checkpoint; the fsync waits off-CPU)', None
    return 'BEGIN, SAVEPOINT, RELEASE', in_sql(frames)


def main():
    args = sys.argv[1:]
    kind = http
    if args and args[0] == '--bare':
        kind, args = bare, args[1:]
    if len(args) != 1:
        sys.exit(__doc__)
    by, detail, total = collections.Counter(), collections.defaultdict(collections.Counter), 0
    for comm, frames in samples(args[0]):
        total += 1
        what, inside = kind(comm, frames)
        by[what] += 1
        if inside:
            detail[what][inside] += 1
    if kind is bare:
        outside = by.pop('outside the measured batches (setup, spinner, ...)', 0)
        total -= outside
        print(f'{outside} samples outside the measured batches (setup, the spinner) left out')
    print(f'{total} samples')
    for what, n in sorted(by.items(), key=lambda item: -item[1]):
        print(f'{100 * n / total:6.1f}%  {what}')
        for inside, m in detail[what].most_common():
            print(f'{100 * m / total:6.1f}%      {inside}')


if __name__ == '__main__':
    main()
