//! A small HTTP client for the admin listener, and versions of a component
//! that differ only in a custom section (same behaviour, another digest).

use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `method path` against `127.0.0.1:port` with an optional bearer token:
/// the status and the body as JSON (a JSON string when it is not JSON).
pub fn call(method: &str, port: u16, path: &str, token: Option<&str>, body: &[u8]) -> (u16, serde_json::Value) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let url = format!("http://127.0.0.1:{port}{path}");
    let auth = token.map(|t| format!("Bearer {t}"));
    let resp = match method {
        "GET" => {
            let mut r = agent.get(&url);
            if let Some(a) = &auth {
                r = r.header("Authorization", a);
            }
            r.call()
        }
        "PUT" | "POST" => {
            let mut r = if method == "PUT" {
                agent.put(&url)
            } else {
                agent.post(&url)
            };
            if let Some(a) = &auth {
                r = r.header("Authorization", a);
            }
            r.send(body)
        }
        other => panic!("method {other}"),
    }
    .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let status = resp.status().as_u16();
    let text = resp
        .into_body()
        .with_config()
        .limit(64 << 20)
        .read_to_string()
        .unwrap_or_default();
    let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, json)
}

/// Wait until the admin listener answers `/health`.
pub fn wait_up(port: u16) {
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "admin listener on {port} never came up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `component` with a custom section `weir-test-version` = `tag` appended:
/// the same code under another digest.
pub fn variant(component: &[u8], tag: &str) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    let name = b"weir-test-version";
    let mut payload = Vec::new();
    leb(name.len(), &mut payload);
    payload.extend_from_slice(name);
    payload.extend_from_slice(tag.as_bytes());
    let mut out = component.to_vec();
    out.push(0); // custom section
    leb(payload.len(), &mut out);
    out.extend_from_slice(&payload);
    out
}

/// sha256 of `bytes`, hex (as the registry names versions).
pub fn digest(bytes: &[u8]) -> String {
    weir::registry::digest(bytes)
}

/// The digest `GET /v1/handlers/{name}` reports as current.
pub fn current(port: u16, token: Option<&str>, name: &str) -> String {
    let (code, body) = call("GET", port, &format!("/v1/handlers/{name}"), token, b"");
    assert_eq!(code, 200, "GET /v1/handlers/{name}: {body}");
    body["current"]["digest"].as_str().unwrap().to_owned()
}
