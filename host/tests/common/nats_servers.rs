//! A real JetStream cluster for the tests: `n` nats-server processes on
//! loopback ports, each with its own store directory, routed to one
//! another. The test starts them, kills and restarts them; dropping the
//! [`NatsServers`] kills whatever still runs and removes the stores.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;

/// The server binary: `WEIR_NATS_SERVER` when set, else `nats-server` on the PATH
/// (Debian's package puts it in /usr/sbin).
fn server_bin() -> String {
    if let Ok(bin) = std::env::var("WEIR_NATS_SERVER") {
        return bin;
    }
    for dir in std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/usr/local/bin"])
    {
        let path = PathBuf::from(dir).join("nats-server");
        if path.exists() {
            return path.display().to_string();
        }
    }
    panic!(
        "nats-server is not installed: the multi-server tests start their own servers \
         (apt-get install nats-server, or set WEIR_NATS_SERVER to the binary)"
    );
}

/// One server of the cluster.
pub struct Server {
    /// Its `server_name` (`n0`, `n1`, …), as JetStream names stream leaders.
    pub name: String,
    /// Its client URL.
    pub url: String,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Server {
    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// When this server logged a line containing `needle`, first after
    /// `after` (UTC, seconds since midnight, as the log's times are).
    pub fn logged_after(&self, needle: &str, after: f64) -> Option<f64> {
        self.log().lines().filter(|l| l.contains(needle)).find_map(|l| {
            // `[pid] 2026/12/03 07:24:31.269004 [INF] …`
            let time = l.split_whitespace().nth(2)?;
            let mut parts = time.split(':');
            let h: f64 = parts.next()?.parse().ok()?;
            let m: f64 = parts.next()?.parse().ok()?;
            let s: f64 = parts.next()?.parse().ok()?;
            let t = h * 3600.0 + m * 60.0 + s;
            (t >= after).then_some(t)
        })
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none(), "{} already runs", self.name);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(server_bin())
            .arg("-c")
            .arg(&self.config)
            // Log times in UTC, to compare them with the test's clock.
            .env("TZ", "UTC")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("starting nats-server {}: {e}", self.name));
        self.child = Some(child);
    }
}

/// Now, in UTC seconds since midnight (the servers' log times).
pub fn utc_time_of_day() -> f64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    now % 86_400.0
}

/// Free loopback ports, all bound at once so none is handed out twice.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    listeners.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

/// A JetStream cluster of nats-server processes.
pub struct NatsServers {
    dir: tempfile::TempDir,
    /// The servers, `n0` first.
    pub servers: Vec<Server>,
}

impl NatsServers {
    /// Start `n` routed servers and wait until the cluster can hold a
    /// stream of `n` replicas.
    pub fn start(n: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let ports = free_ports(2 * n);
        let (client, route) = ports.split_at(n);
        let routes: Vec<String> = route
            .iter()
            .map(|p| format!("\"nats-route://127.0.0.1:{p}\""))
            .collect();
        let mut servers = Vec::new();
        for i in 0..n {
            let name = format!("n{i}");
            let store = dir.path().join(format!("{name}-store"));
            let config = dir.path().join(format!("{name}.conf"));
            std::fs::write(
                &config,
                format!(
                    "server_name: \"{name}\"\nlisten: \"127.0.0.1:{client}\"\n\
                     jetstream {{\n  store_dir: \"{store}\"\n  max_memory_store: 64MB\n  max_file_store: 1GB\n}}\n\
                     cluster {{\n  name: \"weir-test\"\n  listen: \"127.0.0.1:{route}\"\n  routes: [{routes}]\n}}\n",
                    client = client[i],
                    route = route[i],
                    store = store.display(),
                    routes = routes.join(", "),
                ),
            )
            .unwrap();
            servers.push(Server {
                url: format!("nats://127.0.0.1:{}", client[i]),
                log: dir.path().join(format!("{name}.log")),
                name,
                config,
                child: None,
            });
        }
        for s in &mut servers {
            s.spawn();
        }
        let cluster = Self { dir, servers };
        cluster.wait_ready(n, Duration::from_secs(60));
        cluster
    }

    /// One server with JetStream and no cluster (a standalone nats-server of
    /// the test's own, as the shared one is), ready for streams.
    pub fn single() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_ports(1)[0];
        let store = dir.path().join("n0-store");
        let config = dir.path().join("n0.conf");
        std::fs::write(
            &config,
            format!(
                "server_name: \"n0\"\nlisten: \"127.0.0.1:{port}\"\n\
                 jetstream {{\n  store_dir: \"{store}\"\n  max_memory_store: 64MB\n  max_file_store: 1GB\n}}\n",
                store = store.display(),
            ),
        )
        .unwrap();
        let mut server = Server {
            url: format!("nats://127.0.0.1:{port}"),
            log: dir.path().join("n0.log"),
            name: "n0".into(),
            config,
            child: None,
        };
        server.spawn();
        let single = Self {
            dir,
            servers: vec![server],
        };
        single.wait_ready(1, Duration::from_secs(60));
        single
    }

    /// Every server's client URL, `n0` first (a node's `transport.url` list).
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(|s| s.url.clone()).collect()
    }

    /// The server named `name`.
    pub fn server(&mut self, name: &str) -> &mut Server {
        self.servers
            .iter_mut()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no server {name}"))
    }

    /// SIGKILL the server `name`: a crash, nothing flushed.
    pub fn kill(&mut self, name: &str) {
        let s = self.server(name);
        if let Some(mut c) = s.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP the server `name`: it hangs with its sockets open, neither
    /// answering nor refusing (SIGCONT with [`NatsServers::resume`]).
    pub fn stall(&mut self, name: &str) {
        self.signal(name, libc::SIGSTOP);
    }

    /// SIGCONT the stalled server `name`.
    pub fn resume(&mut self, name: &str) {
        self.signal(name, libc::SIGCONT);
    }

    fn signal(&mut self, name: &str, sig: i32) {
        let s = self.server(name);
        let pid = i32::try_from(s.child.as_ref().expect("the server runs").id()).unwrap();
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(pid, sig) };
    }

    /// Start the killed server `name` again, on its ports and its store.
    pub fn restart(&mut self, name: &str) {
        self.server(name).spawn();
    }

    /// Every server's log, for a failure message.
    pub fn logs(&self) -> String {
        self.servers
            .iter()
            .map(|s| {
                let log = s.log();
                let tail: Vec<&str> = log.lines().rev().take(30).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- nats-server {}:\n{}", s.name, tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Wait until a stream of `replicas` replicas can be created through
    /// every server (routes up, a meta leader elected, every peer known),
    /// then delete the probe stream.
    pub fn wait_ready(&self, replicas: usize, timeout: Duration) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let start = Instant::now();
        for s in &self.servers {
            let probe = format!("ready-probe-{}", s.name);
            let mut last = String::new();
            let ok = rt.block_on(async {
                while start.elapsed() < timeout {
                    match probe_stream(&s.url, &probe, replicas).await {
                        Ok(()) => return true,
                        Err(e) => last = e,
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                false
            });
            assert!(
                ok,
                "the nats cluster was not ready within {timeout:?} (a stream of {replicas} replicas through {}): {last}\n{}",
                s.name,
                self.logs()
            );
        }
    }

    /// The server that leads `stream` now, asked through any of `urls`.
    pub async fn stream_leader(urls: &[String], stream: &str) -> Result<String, String> {
        let client = connect(urls).await?;
        let js = jetstream::new(client);
        let mut s = js.get_stream(stream).await.map_err(|e| e.to_string())?;
        let info = s.info().await.map_err(|e| e.to_string())?;
        info.cluster
            .as_ref()
            .and_then(|c| c.leader.clone())
            .ok_or_else(|| format!("stream {stream} has no leader: {:?}", info.cluster))
    }
}

/// A client of any of `urls` (tried in order).
pub async fn connect(urls: &[String]) -> Result<async_nats::Client, String> {
    let connect = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(2))
        .request_timeout(Some(Duration::from_secs(3)))
        .retain_servers_order()
        .connect(urls);
    connect.await.map_err(|e| format!("connecting to {urls:?}: {e}"))
}

/// Create (and delete) a file stream of `replicas` replicas through `url`.
async fn probe_stream(url: &str, name: &str, replicas: usize) -> Result<(), String> {
    let client = connect(&[url.to_owned()]).await?;
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .map_err(|e| format!("creating {name}: {e}"))?;
    js.delete_stream(name)
        .await
        .map_err(|e| format!("deleting {name}: {e}"))?;
    Ok(())
}

impl Drop for NatsServers {
    fn drop(&mut self) {
        for s in &mut self.servers {
            if let Some(mut c) = s.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
