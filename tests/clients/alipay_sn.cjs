// `make test-clients`: the certificate SNs payonce's tests expect
// (tests/fixtures/alipay-cert/expected_sn.txt, checked against payonce by
// src/platforms/alipay/certs.rs) recomputed by Alipay's official Node.js
// SDK, `alipay-sdk` (pinned in package.json and package-lock.json), through
// its public API: an AlipaySdk in certificate mode reads the three
// certificates and computes appCertSn, alipayCertSn and alipayRootCertSn
// (the root file holds two RSA roots and an ECDSA one, which the SDK leaves
// out). Exits 1 naming each SN that differs.
'use strict';
const fs = require('node:fs');
const path = require('node:path');
const { AlipaySdk } = require('alipay-sdk');

const fixtures = path.join(__dirname, '..', 'fixtures');
const dir = path.join(fixtures, 'alipay-cert');
const sdk = new AlipaySdk({
  appId: '2021000000000000',
  // Any RSA key: the SDK requires one; the SNs do not depend on it.
  privateKey: fs.readFileSync(path.join(fixtures, 'TEST_ONLY_merchant_other_private.pem'), 'ascii'),
  keyType: 'PKCS8',
  appCertPath: path.join(dir, 'TEST_ONLY_app_cert.crt'),
  alipayPublicCertPath: path.join(dir, 'TEST_ONLY_alipay_public_cert.crt'),
  alipayRootCertPath: path.join(dir, 'TEST_ONLY_alipay_root_cert.crt'),
});
const computed = {
  app_cert_sn: sdk.config.appCertSn,
  alipay_cert_sn: sdk.config.alipayCertSn,
  alipay_root_cert_sn: sdk.config.alipayRootCertSn,
};
const expected = Object.fromEntries(
  fs.readFileSync(path.join(dir, 'expected_sn.txt'), 'utf8')
    .split('\n').filter(Boolean).map((line) => line.split('=')),
);
let failed = 0;
for (const [name, value] of Object.entries(computed)) {
  if (expected[name] === value && value) {
    console.log(`  ${name} = ${value} (alipay-sdk agrees)`);
  } else {
    console.log(`  ${name}: alipay-sdk computes ${value}, expected_sn.txt says ${expected[name]}`);
    failed += 1;
  }
}
if (Object.keys(expected).length !== Object.keys(computed).length) {
  console.log(`  expected_sn.txt names ${Object.keys(expected)}; the SDK computes ${Object.keys(computed)}`);
  failed += 1;
}
process.exit(failed === 0 ? 0 : 1);
