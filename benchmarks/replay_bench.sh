#!/usr/bin/env bash
# Run benchmarks/replay_bench.py with its peers (cpprb, TorchRL) installed in a throw-away venv,
# so that they never become project dependencies. Usage: bash benchmarks/replay_bench.sh [args]
set -u
cd "$(dirname "$0")/.."
VENV=.cache/bench_venv_replay
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || exit 1
    "$VENV/bin/pip" install --quiet --upgrade pip
fi
if [ ! -f "$VENV/.peers_tried" ]; then
    "$VENV/bin/pip" install --quiet numpy || exit 1
    "$VENV/bin/pip" install --quiet cpprb || echo "replay_bench: cpprb failed to install; continuing without it"
    "$VENV/bin/pip" install --quiet torch==2.14.1 torchrl || echo "replay_bench: torchrl failed to install; continuing without it"
    touch "$VENV/.peers_tried"
fi
exec "$VENV/bin/python" benchmarks/replay_bench.py "$@"
