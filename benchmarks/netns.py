"""Network namespaces joined by rate-shaped links, for ``python -m benchmarks e2e``.

``Topology(n, per_host=L)`` builds n / L "hosts" of L ranks each (default L = 1: a host per rank)
and one "switch" out of Linux network namespaces, all named with the prefix ``hq<pid>``
(``hq<pid>s`` the switch, ``hq<pid>r<j>`` host j, which holds ranks j L .. j L + L - 1):

    host j:  lo, and veth0 with address 10.A.B.(j+1)/24
    switch:  lo, bridge br0 with address 10.A.B.254/24, and port<j>: the other end of host j's veth0

The ranks of one host share its namespace and its veth0: what they send each other stays inside
the namespace (the kernel delivers traffic to its own address locally), and only traffic between
hosts crosses the shaped link.

Each veth is created directly inside its two namespaces (``ip -n <switch> link add ... peer ...
netns <rank>``), so nothing of the root namespace (interfaces, addresses, routes) is touched, and
the only traffic on these links is between the namespaces. ``shape(rate)`` puts a token-bucket
filter (``tc qdisc replace ... root tbf rate R burst ... latency ...``) on the egress of both ends of
every veth: rank i sends at most R into the switch and the switch sends at most R to rank i, a
full-duplex R link like a NIC plugged into a switch. ``destroy()`` deletes the namespaces, which
deletes their interfaces and qdiscs with them.

Host name. Gloo endpoints that Horovod creates without an interface (the contexts of its process
sets, the global one included, in Horovod 0.28) bind to the address this machine's host name
resolves to. ``ip netns exec`` bind-mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``, so
every rank namespace gets such a file naming the host after its own veth0 address (the root
namespace's ``/etc/hosts`` is not changed; the files go with the namespaces).

Byte counters: ``counters(i)`` reads rank i's host's veth0 ``tx_bytes`` / ``rx_bytes``. A process run
with ``ip netns exec`` sees its namespace's ``/sys/class/net`` and can read them itself
(``read_counters``). They count whole frames: Ethernet, IP and TCP headers included, one set of
headers per (possibly segmentation-offloaded, up to 64 KiB) packet as the veth hands it on.
"""
import json
import os
import re
import shutil
import socket
import subprocess

IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"
IFACE = "veth0"
ETC_NETNS = "/etc/netns"
_NAME = re.compile(r"^hq(\d+)(s|r\d+)$")


class NetnsError(RuntimeError):
    """The namespaces could not be made (not root, ``ip``/``tc`` missing, a failing command)."""


def _run(cmd, check=True, timeout=30):
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(cmd)}: {e}") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stdout.strip()}")
    return proc.stdout


def parse_rate(text):
    """A tc rate ('100mbit', '1gbit', '2.5gbit', '800kbit', '1e9bit') in bits/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*", text.lower())
    if not m:
        raise ValueError(f"not a rate in bit/s (e.g. 100mbit, 1gbit, 10gbit): {text!r}")
    bps = float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[m.group(2)]
    if bps <= 0:
        raise ValueError(f"a rate must be positive: {text!r}")
    return bps


def tbf_params(rate_bps):
    """(burst bytes, latency ms) of the token bucket: a burst of 1 ms at the rate (at least 64 KiB,
    the largest offloaded packet), and a queue of 20 ms at the rate beyond it."""
    return max(64 * 1024, int(rate_bps / 8 * 1e-3)), 20


def unavailable_reason():
    """Why namespaces cannot be made here, or None (checks root, ``ip`` and ``tc``; a failing
    ``ip netns add`` is reported by ``Topology.create``)."""
    if os.geteuid() != 0:
        return "not running as root (network namespaces, veth pairs and tc qdiscs need CAP_NET_ADMIN)"
    for tool in (IP, TC):
        if not os.access(tool, os.X_OK):
            return f"{os.path.basename(tool)} (iproute2) is not installed"
    return None


def probe():
    """Why namespaces cannot be made here, or None: ``unavailable_reason()``, then one namespace is
    made and deleted."""
    reason = unavailable_reason()
    if reason:
        return reason
    name = f"hq{os.getpid()}s"
    try:
        _run([IP, "netns", "add", name])
    except NetnsError as e:
        return f"ip netns add failed: {e}"
    _run([IP, "netns", "del", name], check=False)
    return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces():
    out = _run([IP, "netns", "list"], check=False)
    return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


def remove_stale():
    """Delete namespaces of this naming scheme whose creating process is gone; their names."""
    stale = []
    for name in list_namespaces():
        m = _NAME.match(name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            _run([IP, "netns", "del", name], check=False)
            stale.append(name)
    if os.path.isdir(ETC_NETNS):
        for name in os.listdir(ETC_NETNS):
            m = _NAME.match(name)
            if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
                shutil.rmtree(_etc_dir(name), ignore_errors=True)
    return stale


def _etc_dir(ns):
    return os.path.join(ETC_NETNS, ns)


def read_counters(iface=IFACE):
    """(tx_bytes, rx_bytes) of ``iface`` in the caller's own network namespace."""
    base = f"/sys/class/net/{iface}/statistics/"
    with open(base + "tx_bytes") as f:
        tx = int(f.read())
    with open(base + "rx_bytes") as f:
        rx = int(f.read())
    return tx, rx


def tcp_retransmits():
    """TCP segments retransmitted so far in the caller's own network namespace (/proc/net/snmp's
    Tcp RetransSegs): a link that drops packets (a full token-bucket queue) carries their bytes again."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


class Topology:
    """n ranks on n / per_host host namespaces, and a switch namespace (see the module docstring).
    ``hosts``: the host namespaces; ``ranks``: each rank's namespace (its host's)."""

    def __init__(self, n, prefix=None, per_host=1):
        if per_host < 1 or n % per_host:
            raise ValueError(f"{n} ranks do not fill hosts of {per_host} ranks")
        self.n = n
        self.per_host = per_host
        self.prefix = prefix or f"hq{os.getpid()}"
        self.switch = f"{self.prefix}s"
        self.hosts = [f"{self.prefix}r{j}" for j in range(n // per_host)]
        self.ranks = [self.hosts[i // per_host] for i in range(n)]
        pid = os.getpid()
        self.subnet = f"10.{200 + (pid >> 8) % 50}.{pid % 256}"
        self.created = []
        self.rate = None
        self._made_etc = False  # whether /etc/netns was made here (removed again when left empty)

    def address(self, j):
        """Host j's address."""
        return f"{self.subnet}.{j + 1}"

    @property
    def switch_address(self):
        return f"{self.subnet}.254"

    def _ns(self, name, *cmd):
        return _run([IP, "-n", name] + list(cmd))

    def _no_ipv6(self, ns):
        # no router solicitations or MLD reports on the measured links (best effort)
        _run([IP, "netns", "exec", ns, "sh", "-c",
              "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; "
              "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6"], check=False)

    def create(self):
        reason = unavailable_reason()
        if reason:
            raise NetnsError(reason)
        for ns in [self.switch] + self.hosts:
            _run([IP, "netns", "add", ns])
            self.created.append(ns)
            self._no_ipv6(ns)
            self._ns(ns, "link", "set", "lo", "up")
        self._ns(self.switch, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        self._ns(self.switch, "addr", "add", f"{self.switch_address}/24", "dev", "br0")
        self._ns(self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            port = f"port{i}"
            self._ns(self.switch, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns)
            self._ns(self.switch, "link", "set", port, "master", "br0")
            self._ns(self.switch, "link", "set", port, "up")
            self._ns(ns, "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
            self._write_hosts(ns, self.address(i))
            self._ns(ns, "link", "set", IFACE, "up")
        return self

    def _write_hosts(self, ns, address):
        try:
            if not os.path.isdir(ETC_NETNS):
                os.makedirs(ETC_NETNS)
                self._made_etc = True
            os.makedirs(_etc_dir(ns), exist_ok=True)
            with open(os.path.join(_etc_dir(ns), "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
        except OSError as e:
            raise NetnsError(f"cannot write {_etc_dir(ns)}/hosts: {e}") from None

    def shape(self, rate):
        """Token-bucket every link end to ``rate`` (a tc rate such as '1gbit')."""
        burst, latency_ms = tbf_params(parse_rate(rate))
        tbf = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", f"{latency_ms}ms"]
        for i, ns in enumerate(self.hosts):
            _run([TC, "-n", ns, "qdisc", "replace", "dev", IFACE] + tbf)
            _run([TC, "-n", self.switch, "qdisc", "replace", "dev", f"port{i}"] + tbf)
        self.rate = rate
        return dict(rate=rate, burst_bytes=burst, latency_ms=latency_ms)

    def qdiscs(self):
        """tc's description of every shaped link end (for the record)."""
        lines = []
        for i, ns in enumerate(self.hosts):
            lines.append(f"{ns} {IFACE}: " + _run([TC, "-n", ns, "qdisc", "show", "dev", IFACE]).strip())
            lines.append(f"{self.switch} port{i}: " +
                         _run([TC, "-n", self.switch, "qdisc", "show", "dev", f"port{i}"]).strip())
        return lines

    def counters(self, i):
        """(tx_bytes, rx_bytes) of rank i's host's veth0, read from outside."""
        data = json.loads(_run([IP, "-n", self.ranks[i], "-s", "-j", "link", "show", IFACE]))
        stats = data[0]["stats64"]
        return stats["tx"]["bytes"], stats["rx"]["bytes"]

    def destroy(self):
        """Delete every namespace this object created (and with them their links); returns the
        names that could not be deleted."""
        for ns in reversed(self.created):
            _run([IP, "netns", "del", ns], check=False)
            shutil.rmtree(_etc_dir(ns), ignore_errors=True)
        if self._made_etc:
            try:
                os.rmdir(ETC_NETNS)  # only if empty
            except OSError:
                pass
        existing = set(list_namespaces())
        left = [ns for ns in self.created if ns in existing]
        self.created = left
        return left

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.destroy()
