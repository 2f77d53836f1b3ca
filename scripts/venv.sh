# Sourced by scripts/run.sh and scripts/test.sh: create .venv once, reinstall when
# pyproject.toml or constraints.txt change. Needs only python3.11 (or python3) on PATH.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-$(command -v python3.11 || command -v python3)}
venv=$root/.venv
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp=$venv/.somatize-installed
want=$(cat "$root/pyproject.toml" "$root/constraints.txt" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet -c "$root/constraints.txt" -e "$root[dev]"
  echo "$want" > "$stamp"
fi
export PATH=$venv/bin:$PATH
