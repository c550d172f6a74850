//! The in-process payonce: the library's `App` behind its own HTTP edge on
//! loopback, configured with the public halves of the keys the simulator
//! signs with. The scenarios that talk to the platforms' APIs start more of
//! them, each on its own database, clock and platform settings.

use crate::alipay_certs::{self, CertSetup, KeyMode};
use crate::platform::{Keys, WechatpayKeys, WECHATPAY_APPID};
use crate::platform_api::{PlatformApi, WechatpayApiConfig};
use crate::s;
use crate::standalone::MERCHANT_SERIAL;
use payonce::app::Config;
use payonce::domain::Rewards;
use payonce::http::{Server, WORKERS_DEFAULT};
use payonce::platforms::alipay::{Alipay, AlipayConfig};
use payonce::platforms::generic::Generic;
use payonce::platforms::wechatpay::{self, Wechatpay, WechatpayConfig};
use payonce::platforms::{Parts, Platform, PlatformSettings, Platforms};
use payonce::{App, Clock};
use rsa::RsaPublicKey;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::Duration;

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

/// How long the simulated WeChat Pay's first platform certificate is valid.
const CERTIFICATE_VALID_MS: i64 = 365 * 86_400_000;

/// The simulated WeChat Pays that serve the in-process payonces' certificate
/// downloads (`--key-mode certificate`), one per platform serial, for the run.
fn certificate_servers() -> &'static parking_lot::Mutex<Vec<Arc<PlatformApi>>> {
    static SERVERS: OnceLock<parking_lot::Mutex<Vec<Arc<PlatformApi>>>> = OnceLock::new();
    SERVERS.get_or_init(Default::default)
}

/// The simulated WeChat Pay of `wx` in certificate mode: its key is a
/// platform certificate under `wx.serial`, listed by its `/v3/certificates`.
pub fn certificate_platform(
    wx: &WechatpayKeys,
    extra: impl FnOnce(&mut WechatpayApiConfig),
) -> Result<PlatformApi, String> {
    let merchant = crate::scenarios::platform_calls::merchant()?;
    let key: &rsa::RsaPrivateKey = wx.signing_key.as_ref();
    let mut config = WechatpayApiConfig {
        platform_key: Some(key.clone()),
        platform_serial: wx.serial.clone(),
        apiv3_key: Some(wx.apiv3_key.clone()),
        certificate_valid_ms: Some(CERTIFICATE_VALID_MS),
        ..WechatpayApiConfig::new(MERCHANT_SERIAL, merchant.public.clone())
    };
    extra(&mut config);
    PlatformApi::start_wechatpay(config)
}

/// payonce's WeChat Pay as `serve --wechatpay-platform-certs auto` builds it
/// (`wechatpay::configure`): no key configured for the platform's serial;
/// its certificates downloaded from `api` at once, and on an unknown serial.
pub fn downloading_wechatpay(
    wx: &WechatpayKeys,
    api: &PlatformApi,
    parts: Parts,
    timeout: Duration,
    public_base_url: Option<&str>,
) -> Result<Platform, String> {
    let merchant = crate::scenarios::platform_calls::merchant()?;
    let apiv3_key = std::str::from_utf8(&wx.apiv3_key).map_err(|_| s("the APIv3 key is not UTF-8"))?;
    // The merchant key is read from a file, as `serve` reads it, once: the
    // file goes as soon as payonce holds the key (no SIGHUP here).
    let dir = std::env::temp_dir().join(format!("payonce-sim-{}-{}", std::process::id(), crate::new_run_id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let key_file = dir.join("merchant-key.pem");
    let written = std::fs::write(&key_file, &merchant.pem).map_err(|e| format!("{}: {e}", key_file.display()));
    let settings = PlatformSettings {
        wechatpay: wechatpay::Settings {
            apiv3_key: Some(apiv3_key.to_owned()),
            mchid: Some(api.merchant_id().to_owned()),
            merchant_serial: Some(MERCHANT_SERIAL.to_owned()),
            merchant_key: Some(key_file.display().to_string()),
            api_base: api.endpoint(),
            appids: vec![WECHATPAY_APPID.to_owned()],
            platform_certs: true,
            // A notice under a serial not yet held asks again at once.
            cert_unknown_serial_interval_s: 0,
            ..wechatpay::Settings::default()
        },
        timeout,
        public_base_url: public_base_url.map(str::to_owned),
        ..PlatformSettings::default()
    };
    let configured = written.and_then(|()| wechatpay::configure(&settings, parts, &mut Vec::new()));
    let _ = std::fs::remove_dir_all(&dir);
    configured
}

/// The in-process payonce's settings: the generic secret, the rewards, and
/// the channels the simulator holds keys for, with their public halves (in
/// `--key-mode certificate`, WeChat Pay's notices verified with the
/// certificates payonce downloads from a simulated WeChat Pay instead).
pub fn config(keys: &Keys) -> Result<Config, String> {
    let downloading = match &keys.wechatpay {
        Some(wx) if wx.certificate => {
            let api = {
                let mut servers = certificate_servers().lock();
                match servers.iter().find(|api| api.platform_serial() == Some(wx.serial.as_str())) {
                    Some(api) => Arc::clone(api),
                    None => {
                        let api = Arc::new(certificate_platform(wx, |_| {})?);
                        servers.push(Arc::clone(&api));
                        api
                    }
                }
            };
            let platform = downloading_wechatpay(wx, &api, Parts::NoticesAndCalls, Duration::from_secs(10), None)?;
            // The notices alone: this payonce makes no platform call.
            Some(Platform { calls: None, ..platform })
        }
        _ => None,
    };
    let wechatpay = match &keys.wechatpay {
        Some(_) if downloading.is_some() => None,
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
    platforms.extend(downloading);
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
