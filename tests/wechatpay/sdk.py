"""WeChat Pay's side, played by the PyPI SDK `wechatpayv3` (pinned in
scripts/wechatpay-venv), for tests/it/wechatpay_sdk.rs.

Reads one JSON object on stdin and answers one on stdout:

- `sign`: [[message, private_key_pem], ...] -> `signatures`: the SDK's
  SHA256withRSA (`wechatpayv3.utils.rsa_sign`) of each message, base64;
- `gateway`, `mchid`, `merchant_serial`, `merchant_key`, `apiv3_key`,
  `public_key_id`, `public_key`: a `wechatpayv3.core.Core` as a merchant
  mid-migration configures it (the WeChat Pay public key, and the platform
  certificates it downloads from `gateway`'s `GET /v3/certificates`) ->
  `certificates`: the serials it downloaded (upper-case hex);
- `notices`: [{"headers": {...}, "body": "..."}, ...] -> `verdicts`: for
  each, whether that Core's `callback` verified and decrypted it.

Without the SDK it answers {"sdk": null}.
"""

import json
import sys

try:
    import importlib.metadata as metadata

    from wechatpayv3 import utils
    from wechatpayv3.core import Core
except ImportError:
    json.dump({"sdk": None}, sys.stdout)
    sys.exit(0)


class Merchant(Core):
    """The SDK's Core, its API base pointed at the simulated WeChat Pay."""

    def __init__(self, gateway, **kwargs):
        self._sim_gateway = gateway
        super().__init__(**kwargs)

    def _init_certificates(self):
        self._gate_way = self._sim_gateway
        self._update_certificates()


def main():
    asked = json.load(sys.stdin)
    answer = {"sdk": metadata.version("wechatpayv3")}
    answer["signatures"] = [
        utils.rsa_sign(utils.load_private_key(key), message) for message, key in asked.get("sign", [])
    ]
    if "gateway" in asked:
        core = Merchant(
            asked["gateway"],
            mchid=asked["mchid"],
            cert_serial_no=asked["merchant_serial"],
            private_key=asked["merchant_key"],
            apiv3_key=asked["apiv3_key"],
        )
        # The public key beside the certificates, as a merchant mid-migration has both.
        core._public_key = utils.load_public_key(asked["public_key"])
        core._public_key_id = asked["public_key_id"]
        answer["certificates"] = [format(c.serial_number, "X") for c in core._certificates]
        verdicts = []
        for notice in asked.get("notices", []):
            try:
                verdicts.append(core.callback(notice["headers"], notice["body"]) is not None)
            except Exception:  # the SDK raises on what it cannot verify
                verdicts.append(False)
        answer["verdicts"] = verdicts
    json.dump(answer, sys.stdout)


main()
