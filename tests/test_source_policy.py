"""The source policy's pure decisions (issue 19, finding 2), table-tested: URIs, addresses,
redirects, resolved file paths, the policy record. Non-loopback hosts are reserved example
names and documentation addresses; nothing here opens a socket."""

from __future__ import annotations

import pytest

from mlx_fleet.source_policy import (DEFAULT_POLICY, DEV_POLICY, REFUSED, PolicyError,
                                     SourcePolicy, check_address, check_file_path,
                                     check_redirect, check_source, hf_token_allowed,
                                     parse_policy)

PRIVATE_OK = SourcePolicy(allow_private_networks=True)
HOSTS = SourcePolicy(https_hosts=("models.example.com", "*.cdn.example.net",
                                  "mirror.example:8443", "any-port.example:*",
                                  "203.0.113.7"))
ROOTS = SourcePolicy(file_roots=("/srv/models", "/Volumes/m/"))
ORGS = SourcePolicy(hf_organizations=("mlx-community",), hf_token_organizations=("acme",))


@pytest.mark.parametrize("policy, uri, rule", [
    # the secure default: https to public hosts, hf:// of any org, no file://, never http://
    (DEFAULT_POLICY, "https://models.example.com/m/", None),
    (DEFAULT_POLICY, "https://models.example.com:8443/m/", None),
    (DEFAULT_POLICY, "hf://mlx-community/Qwen3-0.6B-4bit", None),
    (DEFAULT_POLICY, "http://models.example.com/m/", "schemes"),
    (DEFAULT_POLICY, "HTTP://models.example.com/m/", "schemes"),
    (DEFAULT_POLICY, "s3://bucket/m", "schemes"),
    (DEFAULT_POLICY, "file:///usr", "fileRoots"),
    (DEFAULT_POLICY, "/usr", "fileRoots"),
    # addresses spelled in the URI
    (DEFAULT_POLICY, "https://127.0.0.1:8443/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://10.1.2.3/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://192.168.1.10/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://172.16.0.1/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://100.64.0.1/m/", "allowPrivateNetworks"),  # CGNAT
    (DEFAULT_POLICY, "https://169.254.169.254/latest/", "source"),  # metadata: never
    (PRIVATE_OK, "https://169.254.169.254/latest/", "source"),
    (DEFAULT_POLICY, "https://0.0.0.0:8443/m/", "source"),
    (PRIVATE_OK, "https://0.0.0.0:8443/m/", "source"),
    (DEFAULT_POLICY, "https://[::1]:8443/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://[::]/m/", "source"),
    (DEFAULT_POLICY, "https://[fd12:3456::1]/m/", "allowPrivateNetworks"),  # ULA
    (DEFAULT_POLICY, "https://[fe80::1]/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://[::ffff:127.0.0.1]/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://[::ffff:7f00:1]/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://[::ffff:169.254.169.254]/m/", "source"),
    (DEFAULT_POLICY, "https://[64:ff9b::a00:1]/m/", "allowPrivateNetworks"),  # NAT64 of 10/8
    (DEFAULT_POLICY, "https://[2001:4860::8888]/m/", None),  # a global IPv6 address
    (DEFAULT_POLICY, "https://8.8.8.8/m/", None),
    (PRIVATE_OK, "https://127.0.0.1:8443/m/", None),
    (PRIVATE_OK, "https://[::ffff:10.0.0.1]/m/", None),
    (PRIVATE_OK, "https://[fd12::1]/m/", None),
    # other spellings of an IPv4 address: refused whatever they mean
    (DEFAULT_POLICY, "https://2130706433/m/", "source"),
    (DEFAULT_POLICY, "https://0177.0.0.1/m/", "source"),
    (DEFAULT_POLICY, "https://0x7f.0.0.1/m/", "source"),
    (DEFAULT_POLICY, "https://127.1/m/", "source"),
    (PRIVATE_OK, "https://2130706433/m/", "source"),
    (DEFAULT_POLICY, "https://0x7f000001/m/", "source"),
    (DEFAULT_POLICY, "https://127.0.0.1./m/", "allowPrivateNetworks"),
    # what another parser or a resolver would read differently
    (DEFAULT_POLICY, "https://①②⑦.0.0.1/m/", "allowPrivateNetworks"),  # NFKC: 127.0.0.1
    (DEFAULT_POLICY, "https://%31%32%37.0.0.1/m/", "source"),
    (DEFAULT_POLICY, "https://models.example.com\\.evil.example/m/", "source"),
    (DEFAULT_POLICY, "https://bücher.example/m/", None),  # IDNA: xn--bcher-kva.example
    (HOSTS, "https://ⓜodels.example.com/m/", None),  # NFKC: models.example.com
    # loopback names, trailing dots, user info
    (DEFAULT_POLICY, "https://localhost:8443/m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://LOCALHOST./m/", "allowPrivateNetworks"),
    (DEFAULT_POLICY, "https://mac.localhost/m/", "allowPrivateNetworks"),
    (PRIVATE_OK, "https://localhost:8443/m/", None),
    (DEFAULT_POLICY, "https://models.example.com@127.0.0.1/m/", "source"),
    (DEFAULT_POLICY, "https://user:pw@models.example.com/m/", "source"),
    (HOSTS, "https://models.example.com@evil.example/m/", "source"),
    # the host allow-list (port 443 unless the entry names one)
    (HOSTS, "https://models.example.com/m/", None),
    (HOSTS, "https://Models.Example.COM./m/", None),
    (HOSTS, "https://models.example.com:8443/m/", "httpsHosts"),
    (HOSTS, "https://a.cdn.example.net/m/", None),
    (HOSTS, "https://a.b.cdn.example.net/m/", None),
    (HOSTS, "https://cdn.example.net/m/", "httpsHosts"),  # the wildcard is for subdomains
    (HOSTS, "https://evilcdn.example.net/m/", "httpsHosts"),
    (HOSTS, "https://mirror.example:8443/m/", None),
    (HOSTS, "https://mirror.example/m/", "httpsHosts"),
    (HOSTS, "https://any-port.example:9999/m/", None),
    (HOSTS, "https://203.0.113.7/m/", "allowPrivateNetworks"),  # listed, but documentation
    (HOSTS, "https://models.example.com.evil.example/m/", "httpsHosts"),
    (HOSTS, "https://other.example/m/", "httpsHosts"),
    # file:// under roots, lexically (the agent checks again after resolving symlinks)
    (ROOTS, "file:///srv/models/qwen", None),
    (ROOTS, "/srv/models/qwen", None),
    (ROOTS, "file://localhost/srv/models/qwen", None),
    (ROOTS, "file:///Volumes/m/x", None),
    (ROOTS, "file:///srv/models-evil/x", "fileRoots"),
    (ROOTS, "file:///srv/models/../../etc", "source"),
    (ROOTS, "file:///srv/models/%2e%2e/%2e%2e/etc", "source"),
    (ROOTS, "file://mac.example/srv/models/x", "source"),
    (ROOTS, "file:///usr", "fileRoots"),
    (ROOTS, "hf://anyone/x", None),
    # hf:// organisations
    (ORGS, "hf://mlx-community/Qwen3-0.6B-4bit", None),
    (ORGS, "hf://MLX-Community/Qwen3-0.6B-4bit", None),
    (ORGS, "hf://someone/model", "hfOrganizations"),
    (SourcePolicy(schemes=("https",)), "hf://mlx-community/x", "schemes"),
    (SourcePolicy(schemes=("hf",)), "https://models.example.com/m/", "schemes"),
])
def test_check_source(policy: SourcePolicy, uri: str, rule: str | None) -> None:
    got = check_source(policy, uri)
    if rule is None:
        assert got is None, got
    else:
        assert got is not None and got.rule == rule, (uri, got)
        assert got.message.startswith(REFUSED + ": ")


@pytest.mark.parametrize("ip, default, private_ok", [
    ("8.8.8.8", True, True), ("2001:4860::8888", True, True),
    ("127.0.0.1", False, True), ("127.255.0.9", False, True), ("::1", False, True),
    ("10.0.0.1", False, True), ("192.168.0.1", False, True), ("172.31.255.255", False, True),
    ("100.64.0.1", False, True), ("169.254.1.1", False, True), ("fe80::1", False, True),
    ("fe80::1%en0", False, True), ("fd00::1", False, True), ("::ffff:10.0.0.1", False, True),
    ("::ffff:8.8.8.8", True, True), ("64:ff9b::808:808", True, True),
    ("0.0.0.0", False, False), ("0.1.2.3", False, False), ("::", False, False),
    ("169.254.169.254", False, False), ("fd00:ec2::254", False, False),
    ("::ffff:169.254.169.254", False, False), ("224.0.0.1", False, False),
    ("ff02::1", False, False), ("240.0.0.1", False, False), ("192.0.2.1", False, False),
    ("2001:db8::1", False, False), ("not-an-ip", False, False),
    # 6to4 (2002::/16): judged by the IPv4 address inside, then as itself
    ("2002:c0a8:101::", False, True), ("2002:7f00:1::1", False, True),
    ("2002:a00:1::", False, True), ("2002:a9fe:a9fe::1", False, False),  # metadata inside
    ("2002::1", False, False), ("2002:808:808::1", True, True),  # 0.0.0.0 / public
    # Teredo (2001::/32): server and client inside (the client's bits are inverted); the
    # prefix itself is not global, so only a policy allowing private networks reaches it
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", False, True),    # client 127.0.0.1
    ("2001:0:808:808:8000:63bf:5601:5601", False, False),     # client: metadata
    ("2001:0:a9fe:a9fe:8000:63bf:f7f7:f7f7", False, False),   # server: metadata
    ("2001:0:808:808:8000:63bf:f7f7:f7f7", False, True),      # both public
])
def test_check_address(ip: str, default: bool, private_ok: bool) -> None:
    assert (check_address(DEFAULT_POLICY, ip) is None) is default, ip
    assert (check_address(PRIVATE_OK, ip) is None) is private_ok, ip


def test_redirects() -> None:
    assert check_redirect(HOSTS, "https://a.cdn.example.net/x", 1) is None
    for target, rule in [("http://a.cdn.example.net/x", "schemes"),
                         ("file:///etc/passwd", "schemes"),
                         ("https://other.example/x", "httpsHosts"),
                         ("https://127.0.0.1/x", "httpsHosts")]:
        got = check_redirect(HOSTS, target, 1)
        assert got is not None and got.rule == rule, target
    assert check_redirect(DEFAULT_POLICY, "https://127.0.0.1/x", 1).rule == "allowPrivateNetworks"
    assert check_redirect(DEFAULT_POLICY, "https://m.example/x", 5) is None
    assert check_redirect(DEFAULT_POLICY, "https://m.example/x", 6).rule == "maxRedirects"
    assert check_redirect(SourcePolicy(max_redirects=0), "https://m.example/x", 1) is not None


def test_resolved_file_paths() -> None:
    assert check_file_path(ROOTS, "/srv/models/a/b") is None
    assert check_file_path(ROOTS, "/srv/models") is None
    assert check_file_path(ROOTS, "/srv/modelsX").rule == "fileRoots"  # type: ignore[union-attr]
    # a symlink inside a root resolving out of it: the executor passes both resolved
    assert check_file_path(ROOTS, "/etc/secret", ["/private/srv/models"]) is not None
    assert check_file_path(ROOTS, "/private/srv/models/m", ["/private/srv/models"]) is None
    assert "none are configured" in check_file_path(DEFAULT_POLICY, "/x").message  # type: ignore[union-attr]
    assert check_file_path(DEV_POLICY, "/anything") is None


def test_hf_token_only_for_listed_organisations() -> None:
    assert hf_token_allowed(ORGS, "hf://acme/private-model")
    assert hf_token_allowed(ORGS, "hf://ACME/private-model")
    assert not hf_token_allowed(ORGS, "hf://mlx-community/x")
    assert not hf_token_allowed(DEFAULT_POLICY, "hf://acme/private-model")
    assert not hf_token_allowed(ORGS, "https://acme/x")


def test_policy_record_round_trips_and_rejects_bad_fields() -> None:
    text = """
    schemes: [https, hf]
    httpsHosts: [models.example.com, "*.cdn.example.net:8443"]
    fileRoots: [/srv/models]
    hfOrganizations: [MLX-Community]
    allowPrivateNetworks: true
    maxRedirects: 2
    """
    p = parse_policy(text)
    assert p.schemes == ("https", "hf") and p.hf_organizations == ("mlx-community",)
    assert p.allow_private_networks and p.max_redirects == 2
    assert parse_policy(p.to_json()) == p
    assert parse_policy(None) == parse_policy("") == parse_policy("{}") == DEFAULT_POLICY
    for bad, words in [("schemes: [http]", "http"), ("fileRoots: [relative]", "fileRoots"),
                       ("maxRedirects: 99", "maxRedirects"), ("allowPrivate: true", "unknown"),
                       ("httpsHosts: ['a.example:99999']", "httpsHosts"),
                       ("httpsHosts: ['a b']", "httpsHosts"),
                       ("allowPrivateNetworks: 'yes'", "allowPrivateNetworks"),
                       ("[1, 2]", "mapping"), ("{oops", "JSON/YAML")]:
        with pytest.raises(PolicyError) as e:
            parse_policy(bad)
        assert words in str(e.value), bad
