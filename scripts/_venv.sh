# Sourced by scripts/demo and scripts/test: make .venv with batchgate and its test extra installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "batchgate needs Python 3.11 or newer (found $("$PY" --version 2>&1))" >&2
  exit 1
fi
VENV="$ROOT/.venv"
# constraints.txt pins every dependency, test tools included (uv pip compile: see its header); the
# stamp follows both files, so a changed pin reinstalls
STAMP="$VENV/.installed-$(cat pyproject.toml constraints.txt | "$PY" -c 'import hashlib,sys; print(hashlib.sha1(sys.stdin.buffer.read()).hexdigest()[:12])')"
if [ ! -f "$STAMP" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install --quiet -c constraints.txt -e ".[test]"
  rm -f "$VENV"/.installed-* && touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
