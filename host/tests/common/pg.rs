//! PostgreSQL for the coordinator tests: a database of its own per test
//! (`weir_t_<uuid8>`, dropped on drop, also when the test fails), and a TCP
//! proxy in front of the server that a test can cut to make a node lose
//! its database while the server stays up for everyone else.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::Connection as _;
use sqlx::Row as _;

/// The server the tests use (override with WEIR_TEST_PG_URL, without a database name).
pub fn server() -> String {
    std::env::var("WEIR_TEST_PG_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

fn block_on<T>(f: impl std::future::Future<Output = T> + Send) -> T
where
    T: Send,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(f)
        })
        .join()
        .unwrap()
    })
}

/// A database of this test.
pub struct TestDb {
    /// Its name.
    pub name: String,
}

impl TestDb {
    /// Create it.
    pub fn new() -> Self {
        let name = format!("weir_t_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let create = format!("CREATE DATABASE {name}");
        block_on(async {
            let mut c = sqlx::PgConnection::connect(&format!("{}/postgres", server()))
                .await
                .unwrap();
            sqlx::query(&create).execute(&mut c).await.unwrap();
        });
        Self { name }
    }

    /// Its URL on the real server.
    pub fn url(&self) -> String {
        format!("{}/{}", server(), self.name)
    }

    /// Its URL through `proxy`.
    pub fn url_via(&self, proxy: &Proxy) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{}", proxy.port, self.name)
    }

    /// Run `sql` and return the first column of every row as text.
    pub fn query(&self, sql: &str) -> Vec<Vec<Option<String>>> {
        let url = self.url();
        block_on(async move {
            let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
            let rows = sqlx::query(sql).fetch_all(&mut c).await.unwrap();
            rows.iter()
                .map(|r| {
                    (0..r.len())
                        .map(|i| r.try_get::<Option<String>, _>(i).unwrap())
                        .collect()
                })
                .collect()
        })
    }

    /// Assigned slots whose owner's lease is live, and the owner's name.
    pub fn slot_owners(&self) -> HashMap<u32, String> {
        self.query(
            "SELECT s.slot::text, n.name FROM weir_slots s JOIN weir_nodes n ON n.node_id = s.owner \
             WHERE s.state = 'assigned' AND n.lease_until > now()",
        )
        .into_iter()
        .map(|r| (r[0].as_ref().unwrap().parse().unwrap(), r[1].clone().unwrap()))
        .collect()
    }
}

/// Whether all `slots` are in `owners`, owned only by `nodes`, balanced within one.
pub fn balanced(owners: &HashMap<u32, String>, nodes: &[&str], slots: u32) -> bool {
    let mut per: HashMap<&str, usize> = nodes.iter().map(|n| (*n, 0)).collect();
    let mut only_these = true;
    for owner in owners.values() {
        match per.get_mut(owner.as_str()) {
            Some(n) => *n += 1,
            None => only_these = false,
        }
    }
    let (lo, hi) = (per.values().min().copied(), per.values().max().copied());
    owners.len() == slots as usize && only_these && hi.zip(lo).is_some_and(|(h, l)| h - l <= 1)
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        block_on(async {
            if let Ok(mut c) = sqlx::PgConnection::connect(&format!("{}/postgres", server())).await {
                let _ = sqlx::query(&drop).execute(&mut c).await;
            }
        });
    }
}

/// A TCP proxy to the PostgreSQL server on a free port, on a thread of its own.
pub struct Proxy {
    /// The port it listens on.
    pub port: u16,
    cut: Arc<AtomicBool>,
}

impl Proxy {
    /// Start forwarding.
    pub fn start() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let flag = cut.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let Ok((mut inbound, _)) = listener.accept().await else {
                        return;
                    };
                    let flag = flag.clone();
                    tokio::spawn(async move {
                        if flag.load(Ordering::Relaxed) {
                            return; // refused: dropped at once
                        }
                        let Ok(mut outbound) = tokio::net::TcpStream::connect("127.0.0.1:5432").await else {
                            return;
                        };
                        let copy = tokio::io::copy_bidirectional(&mut inbound, &mut outbound);
                        tokio::pin!(copy);
                        loop {
                            tokio::select! {
                                _ = &mut copy => return,
                                () = tokio::time::sleep(Duration::from_millis(10)) => {
                                    if flag.load(Ordering::Relaxed) { return; }
                                }
                            }
                        }
                    });
                }
            });
        });
        Self { port, cut }
    }

    /// Drop every connection and refuse new ones (the database "goes away").
    pub fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }

    /// Accept connections again.
    pub fn restore(&self) {
        self.cut.store(false, Ordering::Relaxed);
    }
}
