#!/bin/sh
# Install gpuwarden: a virtual environment, the systemd units, the sysusers.d and tmpfiles.d
# entries, an example configuration and the alert rules. `make install` runs this. It is the
# install for a host without the Debian package (`make deb`, docs/package.md): the package puts
# its units in /usr/lib/systemd/system, the distribution's directory, while this script puts
# them in /etc/systemd/system, the administrator's, which also wins over a package's units.
#
#   DESTDIR      staging root (default: none, install onto this machine)
#   PREFIX       where the virtual environment goes (default /opt/gpuwarden; the units expect it)
#   SYSCONFDIR   default /etc
#   UNITDIR      default /etc/systemd/system
#   SYSUSERSDIR  default /usr/lib/sysusers.d
#   TMPFILESDIR  default /usr/lib/tmpfiles.d
#   PYTHON       interpreter for the virtual environment (default python3, 3.11 or newer)
#   PACKAGE      what pip installs (default: this source tree; a wheel file works too)
#   PIP_ARGS     extra pip arguments (for example --no-index --find-links DIR offline)
#   CREATE_USER  1: run systemd-sysusers (default 1 without DESTDIR, 0 with it)
#   RUNBOOK_URL  where you publish docs/runbook.md (http or https); written into the installed
#                alert rules' runbook_url in place of the placeholder gpuwarden.invalid base
#
# A venv is not relocatable: with DESTDIR set it is built in the staging root and the staging
# prefix is then removed from its scripts, so it works once copied to PREFIX.
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
DESTDIR=${DESTDIR:-}
PREFIX=${PREFIX:-/opt/gpuwarden}
SYSCONFDIR=${SYSCONFDIR:-/etc}
UNITDIR=${UNITDIR:-/etc/systemd/system}
SYSUSERSDIR=${SYSUSERSDIR:-/usr/lib/sysusers.d}
TMPFILESDIR=${TMPFILESDIR:-/usr/lib/tmpfiles.d}
PYTHON=${PYTHON:-python3}
PACKAGE=${PACKAGE:-$here}
PIP_ARGS=${PIP_ARGS:-}
if [ -n "$DESTDIR" ]; then CREATE_USER=${CREATE_USER:-0}; else CREATE_USER=${CREATE_USER:-1}; fi
RUNBOOK_URL=${RUNBOOK_URL:-}
RUNBOOK_PLACEHOLDER=https://gpuwarden.invalid/docs/runbook.md
# Checked before anything is installed. The anchors (#alertname) are the rules' own, and sed
# must take the URL literally.
case "$RUNBOOK_URL" in
    "") ;;
    *'#'* | *'|'* | *'&'* | *'\'* | *'"'* | *' '*)
        echo "gpuwarden: RUNBOOK_URL: no '#', '|', '&', backslash, quote or space, got '$RUNBOOK_URL'" >&2
        exit 2 ;;
    http://* | https://*) ;;
    *)
        echo "gpuwarden: RUNBOOK_URL: expected an http:// or https:// URL, got '$RUNBOOK_URL'" >&2
        exit 2 ;;
esac

venv="$DESTDIR$PREFIX/venv"
echo "gpuwarden: virtual environment in $venv"
"$PYTHON" -m venv --clear "$venv"
# shellcheck disable=SC2086 # PIP_ARGS is a list of arguments on purpose
"$venv/bin/pip" install --quiet --disable-pip-version-check $PIP_ARGS "$PACKAGE"
if [ -n "$DESTDIR" ]; then
    # Scripts and activate files name the staging path; point them at the final one.
    grep -rlI --null -- "$DESTDIR$PREFIX" "$venv/bin" | xargs -0 -r sed -i "s|$DESTDIR$PREFIX|$PREFIX|g"
fi

install -d -m 0755 "$DESTDIR$UNITDIR" "$DESTDIR$SYSUSERSDIR" "$DESTDIR$TMPFILESDIR" \
    "$DESTDIR$SYSCONFDIR/gpuwarden" \
    "$DESTDIR$PREFIX/share/prometheus" "$DESTDIR$PREFIX/share/grafana" \
    "$DESTDIR$PREFIX/share/alertmanager"
install -m 0644 "$here/systemd/gpuwarden.service" "$here/systemd/gpuwarden-watch.service" \
    "$DESTDIR$UNITDIR/"
install -m 0644 "$here/systemd/gpuwarden.sysusers" "$DESTDIR$SYSUSERSDIR/gpuwarden.conf"
install -m 0644 "$here/systemd/gpuwarden.tmpfiles" "$DESTDIR$TMPFILESDIR/gpuwarden.conf"
install -m 0644 "$here/configs/prometheus/gpuwarden-rules.yml" "$here/configs/prometheus/dcgm-compat-rules.yml" \
    "$here/configs/prometheus/prometheus.yml" "$DESTDIR$PREFIX/share/prometheus/"
if [ -n "$RUNBOOK_URL" ]; then
    sed -i "s|$RUNBOOK_PLACEHOLDER#|$RUNBOOK_URL#|" "$DESTDIR$PREFIX/share/prometheus/gpuwarden-rules.yml"
else
    echo "gpuwarden: the alert rules' runbook links point at $RUNBOOK_PLACEHOLDER (set RUNBOOK_URL)"
fi
install -m 0644 "$here/configs/grafana/gpuwarden.json" "$DESTDIR$PREFIX/share/grafana/"
install -m 0644 "$here/configs/alertmanager/alertmanager.yml" "$DESTDIR$PREFIX/share/alertmanager/"
# Never overwrite a configuration an operator has edited.
config="$DESTDIR$SYSCONFDIR/gpuwarden/gpuwarden.toml"
if [ ! -e "$config" ]; then
    install -m 0644 "$here/configs/gpuwarden.toml.example" "$config"
fi
install -m 0644 "$here/configs/gpuwarden.toml.example" "$DESTDIR$SYSCONFDIR/gpuwarden/gpuwarden.toml.example"
# LoadCredential= needs the file to exist; an empty one means an anonymous broker.
for secret in mqtt-password watch-mqtt-password; do
    if [ ! -e "$DESTDIR$SYSCONFDIR/gpuwarden/$secret" ]; then
        install -m 0600 /dev/null "$DESTDIR$SYSCONFDIR/gpuwarden/$secret"
    fi
done

if [ "$CREATE_USER" = 1 ]; then
    if [ -n "$DESTDIR" ]; then
        systemd-sysusers --root="$DESTDIR" "$DESTDIR$SYSUSERSDIR/gpuwarden.conf"
    else
        systemd-sysusers "$SYSUSERSDIR/gpuwarden.conf"
        # The state directory, so `gpuwarden check` before the first start finds it.
        systemd-tmpfiles --create "$TMPFILESDIR/gpuwarden.conf"
    fi
fi
if [ -z "$DESTDIR" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
cat <<NEXT
gpuwarden installed. Next:
  edit $SYSCONFDIR/gpuwarden/gpuwarden.toml (broker URL, node_id) and, for a broker with a
  password, put it in $SYSCONFDIR/gpuwarden/mqtt-password (chmod 600; the unit passes it as a
  credential: password_file = "/run/credentials/gpuwarden.service/mqtt-password")
  systemctl enable --now gpuwarden          # on every GPU host
  systemctl enable --now gpuwarden-watch    # on one host off the GPU nodes
NEXT
