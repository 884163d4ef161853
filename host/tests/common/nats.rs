//! NATS helpers shared by the NATS test crates: the server URL, a JetStream
//! context, and a topology whose streams are deleted on drop.

use std::time::Duration;

use async_nats::jetstream;
use weir::transport::nats::names;

/// The server the tests use (override with WEIR_TEST_NATS_URL).
pub fn url() -> String {
    std::env::var("WEIR_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A plain JetStream client of the server at `url`, as an operator's tool would be.
pub async fn js_at(url: &str) -> jetstream::Context {
    jetstream::new(async_nats::connect(url).await.unwrap())
}

/// A topology name of this test; its streams are deleted on drop.
pub struct Topo {
    pub name: String,
    pub url: String,
}

impl Topo {
    /// A fresh topology on the test server.
    pub fn new() -> Self {
        Self::at(url())
    }

    /// A fresh topology on the server at `url`.
    pub fn at(url: String) -> Self {
        Self {
            name: format!("t-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
            url,
        }
    }
}

impl Drop for Topo {
    fn drop(&mut self) {
        let streams = [
            names::stream(&self.name),
            names::dead_letter_stream(&self.name),
            names::attempts_stream(&self.name),
        ];
        let url = self.url.clone();
        super::clean_up_on_a_thread(move || async move {
            let connect = async_nats::connect(url.as_str());
            let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(5), connect).await else {
                return;
            };
            let js = jetstream::new(client);
            for s in streams {
                let _ = js.delete_stream(&s).await;
            }
        });
    }
}
