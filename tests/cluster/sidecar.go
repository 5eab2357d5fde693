package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
)

// sidecarAnnotation names the image the sidecar webhook adds as a container
// called "sidecar", the way service meshes inject theirs.
const sidecarAnnotation = "sidecar.pinswap.dev/image"

// serveSidecar runs a second mutating webhook over TLS (the API server's
// serving certificate, which covers 127.0.0.1). Registered after pinswap's,
// it changes the Pod after pinswap has seen it, so pinswap's
// reinvocationPolicy decides whether the sidecar's image is mirrored.
func serveSidecar(p *pki) (string, *http.Server, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/inject", injectSidecar)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.ServeTLS(l, p.servCert, p.servKey) }()
	return fmt.Sprintf("https://%s/inject", l.Addr()), srv, nil
}

func injectSidecar(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 4<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var review admissionv1.AdmissionReview
	if err := json.Unmarshal(body, &review); err != nil || review.Request == nil {
		http.Error(w, "not an AdmissionReview", http.StatusBadRequest)
		return
	}
	resp := &admissionv1.AdmissionResponse{UID: review.Request.UID, Allowed: true}
	var pod corev1.Pod
	if err := json.Unmarshal(review.Request.Object.Raw, &pod); err == nil {
		image := pod.Annotations[sidecarAnnotation]
		present := false
		for _, c := range pod.Spec.Containers {
			present = present || c.Name == "sidecar"
		}
		if image != "" && !present {
			patch, _ := json.Marshal([]map[string]any{{
				"op":    "add",
				"path":  "/spec/containers/-",
				"value": corev1.Container{Name: "sidecar", Image: image},
			}})
			kind := admissionv1.PatchTypeJSONPatch
			resp.Patch, resp.PatchType = patch, &kind
		}
	}
	review.Response, review.Request = resp, nil
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(review)
}
