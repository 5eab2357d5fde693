# shellcheck shell=bash
# Shell helpers shared by scripts/demo.sh and scripts/bench-admission.sh.
# Source it after setting WORK (a temp dir) and PIDS=() (processes the
# caller's cleanup kills). Needs curl, python3, openssl, docker-registry.

ensure_tools() { # CMD:PACKAGE...: apt-get install the packages whose command is missing
  local missing=() pair
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")
  done
  if ((${#missing[@]})); then
    echo "== installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_for() { # URL PID WHAT [CURL ARGS...]: poll URL until it answers 2xx
  local url=$1 pid=$2 what=$3
  shift 3
  for _ in $(seq 200); do
    kill -0 "$pid" 2>/dev/null || { echo "$what exited" >&2; return 1; }
    curl -fs -o /dev/null "$@" "$url" && return 0
    sleep 0.05
  done
  echo "$what did not come up at $url" >&2
  return 1
}

start_registry() { # NAME VAR [USER:PASSWORD]: a loopback Distribution registry; host:port into VAR
  # With USER:PASSWORD, the registry asks for basic auth (htpasswd, bcrypt;
  # needs htpasswd from apache2-utils) and refuses anonymous requests.
  local name=$1 port auth='' probe=()
  port=$(free_port)
  mkdir -p "$WORK/$name"
  if [ -n "${3:-}" ]; then
    htpasswd -Bbn "${3%%:*}" "${3#*:}" >"$WORK/$name.htpasswd"
    auth="auth: {htpasswd: {realm: $name, path: $WORK/$name.htpasswd}}"
    probe=(-u "$3")
  fi
  cat >"$WORK/$name.yml" <<YML
version: 0.1
log: {level: error, accesslog: {disabled: true}}
storage: {filesystem: {rootdirectory: $WORK/$name}, delete: {enabled: true}, cache: {blobdescriptor: inmemory}}
http: {addr: 127.0.0.1:$port}
$auth
YML
  docker-registry serve "$WORK/$name.yml" >"$WORK/$name.log" 2>&1 &
  PIDS+=($!)
  wait_for "http://127.0.0.1:$port/v2/" $! "registry $name" "${probe[@]}"
  printf -v "$2" '127.0.0.1:%s' "$port"
}

make_certs() { # NAME: $WORK/ca.crt, and $WORK/tls.{crt,key} for 127.0.0.1 signed by it
  # rustls refuses a CA:TRUE certificate as a server certificate: issue a leaf.
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
    -subj "/CN=$1 CA" -keyout "$WORK/ca.key" -out "$WORK/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -subj "/CN=127.0.0.1" -keyout "$WORK/tls.key" -out "$WORK/tls.csr" 2>/dev/null
  printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
    "extendedKeyUsage=serverAuth" "subjectAltName=IP:127.0.0.1" >"$WORK/leaf.ext"
  openssl x509 -req -days 1 -in "$WORK/tls.csr" -CA "$WORK/ca.crt" -CAkey "$WORK/ca.key" \
    -CAcreateserial -extfile "$WORK/leaf.ext" -out "$WORK/tls.crt" 2>/dev/null
  openssl verify -CAfile "$WORK/ca.crt" "$WORK/tls.crt" >/dev/null
}
