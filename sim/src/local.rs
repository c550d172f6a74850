//! The in-process payonce: the library's `App` behind its own HTTP edge on
//! loopback, configured with the public halves of the keys the simulator
//! signs with. The scenarios that talk to the platforms' APIs start more of
//! them, each on its own database, clock and platform settings.

use crate::alipay_certs::{self, CertSetup, KeyMode};
use crate::platform::Keys;
use crate::s;
use payonce::app::Config;
use payonce::domain::Rewards;
use payonce::http::{Server, WORKERS_DEFAULT};
use payonce::platforms::alipay::{Alipay, AlipayConfig};
use payonce::platforms::generic::Generic;
use payonce::platforms::wechatpay::{Wechatpay, WechatpayConfig};
use payonce::platforms::{Platform, Platforms};
use payonce::{App, Clock};
use rsa::RsaPublicKey;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;

/// The coupon template and points rate of the in-process payonce.
pub const SIM_COUPON: &str = "SIM-COUPON";
pub const SIM_POINTS_PER_YUAN: i64 = 1;

pub struct LocalServer {
    pub addr: SocketAddr,
    /// The payonce it serves, for what has no HTTP API: its sweeper and
    /// platform-call pool, driven a round at a time by the scenarios.
    pub app: Arc<App>,
    shutdown: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<bool>>,
}

/// Certificate mode's files for the simulated Alipay's key, with the
/// merchant's key of the scenarios that call the platforms.
pub fn alipay_setup(ali: &crate::platform::AlipayKeys) -> Result<Arc<CertSetup>, String> {
    let (pem, key) = crate::scenarios::merchant_key()?;
    alipay_certs::setup(&ali.signing_key.as_ref().to_public_key(), &pem, &key)
}

/// The in-process payonce's settings: the generic secret, the rewards, and
/// the channels the simulator holds keys for, with their public halves.
pub fn config(keys: &Keys) -> Result<Config, String> {
    let wechatpay = match &keys.wechatpay {
        Some(wx) => {
            let public = RsaPublicKey::from(wx.signing_key.as_ref());
            let apiv3_key = std::str::from_utf8(&wx.apiv3_key).map_err(|_| s("the APIv3 key is not UTF-8"))?;
            Some(WechatpayConfig::new(apiv3_key, vec![(wx.serial.clone(), public)])?)
        }
        None => None,
    };
    let alipay = keys.alipay.as_ref().map(|ali| AlipayConfig {
        public_key: RsaPublicKey::from(ali.signing_key.as_ref()),
        app_id: ali.app_id.clone(),
    });
    let mut platforms = vec![Platform::notices(Generic::new(vec![keys.generic_secret.clone()]))];
    platforms.extend(wechatpay.map(|config| Platform::notices(Wechatpay::new(config))));
    match (keys.key_mode, &keys.alipay) {
        (KeyMode::Certificate, Some(ali)) => {
            // Certificate mode: the three certificate files, as `payonce serve` reads them.
            platforms.push(alipay_setup(ali)?.payonce_alipay(&ali.app_id, None)?);
        }
        _ => platforms.extend(alipay.map(|config| Platform::notices(Alipay::new(config)))),
    }
    Ok(Config {
        rewards: Rewards { coupon_templates: vec![SIM_COUPON.into()], points_per_yuan: SIM_POINTS_PER_YUAN },
        platforms: Platforms::with(platforms),
        ..Config::default()
    })
}

impl LocalServer {
    /// payonce on `:memory:` with the generic secret and the channels the
    /// simulator holds keys for, configured with their public halves.
    pub fn start(keys: &Keys) -> Result<LocalServer, String> {
        LocalServer::open(":memory:", Clock::System, config(keys)?)
    }

    /// payonce on `db` (`:memory:` or a file) with `clock` and `config`.
    pub fn open(db: &str, clock: Clock, config: Config) -> Result<LocalServer, String> {
        let app = App::open(db, clock, config).map_err(|e| e.message)?;
        LocalServer::serve(Arc::new(app))
    }

    /// `app` behind its HTTP edge on a free loopback port.
    pub fn serve(app: Arc<App>) -> Result<LocalServer, String> {
        let server = Server::bind("127.0.0.1:0").map_err(|e| e.message)?;
        let addr = server.local_addr();
        let shutdown = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&shutdown);
        let served = Arc::clone(&app);
        let handle = thread::Builder::new()
            .name("payonce-simulated-server".into())
            .spawn(move || server.serve(served, flag, WORKERS_DEFAULT))
            .map_err(|e| format!("cannot start the in-process payonce: {e}"))?;
        Ok(LocalServer { addr, app, shutdown, handle: Some(handle) })
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}
