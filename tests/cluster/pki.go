package main

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki holds the paths of the control plane's keys and certificates, all
// made fresh for each run: one CA signs the API server's serving
// certificate and the client certificates; the ServiceAccount token key is
// separate.
type pki struct {
	dir       string
	caCert    string
	caKey     *ecdsa.PrivateKey
	ca        *x509.Certificate
	servCert  string
	servKey   string
	saKey     string
	saPub     string
	adminCert string
	adminKey  string
	kcmCert   string
	kcmKey    string
	// The API server's client certificate towards kubelets.
	kubeletClientCert string
	kubeletClientKey  string
}

func newPKI(dir string) (*pki, error) {
	p := &pki{dir: filepath.Join(dir, "pki")}
	if err := os.MkdirAll(p.dir, 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "pinswap-cluster-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(7 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	p.ca, _ = x509.ParseCertificate(der)
	p.caKey = key
	p.caCert = p.path("ca.crt")
	if err := writePEM(p.caCert, "CERTIFICATE", der); err != nil {
		return nil, err
	}

	// kubernetes.default.svc names and the Service's ClusterIP are what
	// in-cluster clients check (the node's Pods connect to the ClusterIP);
	// the suite's clients connect to 127.0.0.1.
	p.servCert, p.servKey, err = p.leaf("apiserver", "kube-apiserver", nil,
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		[]net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(apiClusterIP)}, x509.ExtKeyUsageServerAuth)
	if err != nil {
		return nil, err
	}
	p.adminCert, p.adminKey, err = p.leaf("admin", "pinswap-admin", []string{"system:masters"}, nil, nil, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return nil, err
	}
	p.kcmCert, p.kcmKey, err = p.leaf("controller-manager", "system:kube-controller-manager", nil, nil, nil, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return nil, err
	}

	p.kubeletClientCert, p.kubeletClientKey, err = p.leaf("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
		[]string{"system:masters"}, nil, nil, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return nil, err
	}

	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	p.saKey, p.saPub = p.path("sa.key"), p.path("sa.pub")
	if err := writeKey(p.saKey, saKey); err != nil {
		return nil, err
	}
	pub, err := x509.MarshalPKIXPublicKey(&saKey.PublicKey)
	if err != nil {
		return nil, err
	}
	if err := writePEM(p.saPub, "PUBLIC KEY", pub); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *pki) path(name string) string { return filepath.Join(p.dir, name) }

// leaf issues a certificate signed by the CA and returns its and its key's
// paths.
func (p *pki) leaf(name, cn string, orgs, dns []string, ips []net.IP, usage x509.ExtKeyUsage) (string, string, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(7 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		DNSNames:     dns,
		IPAddresses:  ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		return "", "", fmt.Errorf("%s certificate: %w", name, err)
	}
	cert, keyPath := p.path(name+".crt"), p.path(name+".key")
	if err := writePEM(cert, "CERTIFICATE", der); err != nil {
		return "", "", err
	}
	return cert, keyPath, writeKey(keyPath, key)
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

func writeKey(path string, key crypto.Signer) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	return writePEM(path, "PRIVATE KEY", der)
}

func writePEM(path, kind string, der []byte) error {
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600)
}
